// metal_emulation.h: just enough of the Metal Shading Language (MSL) to compile
// a kernel body written for mx.fast.metal_kernel as C++ and run it on a CPU.
// seqlib.emulation compiles MLX's generated text for each call against this
// header (see runner.py, recording.py and codegen.py).
//
// MSL is C++14 with address-space qualifiers, vector types, a math library and
// GPU execution rules.  This header supplies:
//   - the qualifiers `device`, `constant`, `thread`, `threadgroup` (empty: one
//     flat address space; `threadgroup` *declarations* are rewritten by the
//     code generator into storage shared by the threads of one group);
//   - the scalar and vector types the kernels use (uint3, half, bfloat16_t);
//   - namespace metal: math (exp, tanh, ...), atomics, barriers and SIMD-group
//     collectives (simd_sum, simd_max, simd_shuffle_down, ...);
//   - a scheduler that runs the threads of a threadgroup as cooperative fibers.
//     A thread runs until it reaches a barrier or a SIMD collective, then the
//     next one runs.  A barrier releases only when every thread of the group
//     has arrived; a collective only when every live lane of its 32-wide SIMD
//     group has.  The order in which ready threads run (and the order of the
//     threadgroups) is forward, reverse or random, so a kernel that reads
//     another thread's threadgroup memory without a barrier reads the NaN fill
//     under some order and fails.  A barrier without mem_flags::mem_threadgroup
//     after threadgroup writes is refused (it would not order them on a GPU),
//     and so are lanes of one SIMD group waiting at collectives on different
//     source lines (divergent branches: separate reductions on a GPU);
//   - instruments (emu::Instruments): counts of barrier releases and arrivals,
//     atomic operations and SIMD collectives, in total and per thread, and,
//     when asked, which thread last changed each element of each output.
//
// Threadgroups run one after another; a group at the edge of the grid has
// only the threads that lie inside the grid (Metal's non-uniform threadgroups),
// and threads_per_threadgroup is that group's actual size.
//
// Kernels compile as -std=c++14 -pedantic-errors (compiler.py), as MSL is C++14.
// Not emulated (a run on a real Mac is still needed for these): GPU memory
// ordering between threadgroups and co-residency, device-memory ordering within
// a group (always coherent here), divergent SIMD collectives (refused, not run),
// fast-math precision, register pressure, the speed of anything, and Metal's
// compile-time rejections beyond C++14 (see lint.py).
#pragma once

// Fibers switch with _setjmp/_longjmp between their own stacks, which the
// fortified longjmp of some distributions (Ubuntu's default -D_FORTIFY_SOURCE)
// mistakes for a jump into a dead frame.  This header comes first in the unit.
#undef _FORTIFY_SOURCE

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS hides ucontext behind this (the workflow runs the emulation there too)
#endif

#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/types.h>
#include <ucontext.h>

// ---------------------------------------------------------------- types

struct uint3 {
  uint x, y, z;
};

typedef _Float16 half;
typedef half float16_t;

// bfloat16: the top 16 bits of a float32, rounded to nearest even.
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float value) {
    uint32_t word;
    std::memcpy(&word, &value, 4);
    if ((word & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((word >> 16) | 0x40u);  // quiet NaN
    } else {
      bits = uint16_t((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    uint32_t word = uint32_t(bits) << 16;
    float value;
    std::memcpy(&value, &word, 4);
    return value;
  }
};
typedef bfloat16_t bfloat;

namespace metal {
// Declared here because the scheduler reads a barrier's flags (threadgroup_barrier below).
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
}  // namespace metal

// ---------------------------------------------------------------- the scheduler

namespace emu {

enum class State { ready, at_barrier, at_simd, done };

struct ThreadIds {
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threads_per_threadgroup;
  uint3 threads_per_grid;
  uint3 threadgroups_per_grid;
  uint thread_index_in_threadgroup;
  uint thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup;
  uint threads_per_simdgroup;
};

constexpr int kSimdWidth = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kThreadgroupMemoryLimit = 32768;  // bytes, as on Apple GPUs
constexpr size_t kStackSize = 128 * 1024;
constexpr int kMaxDeclarations = 64;
constexpr int kSlotBytes = 16;
constexpr size_t kCompareChunk = 256;  // bytes compared at once when attributing writes
constexpr int kTextFirstLine = 3;  // MLX's kernel text starts on this line of the emulated source (codegen.py)

typedef void (*Body)(const ThreadIds&, void**);

// What a launch counts, filled in for the caller (recording.py mirrors this layout
// with ctypes).  Per-thread arrays are indexed by the thread's linear position
// in the grid, x + gx * (y + gy * z); a null pointer means "not recorded".
struct Instruments {
  uint64_t barriers;          // barrier releases (one per rendezvous of a whole group)
  uint64_t barrier_waits;     // arrivals at a barrier, one per thread per barrier
  uint64_t atomics;           // atomic operations executed
  uint64_t simd_collectives;  // SIMD-group collectives completed (one per SIMD group per call)
  uint32_t* thread_barriers;  // per thread: barriers reached
  uint32_t* thread_atomics;   // per thread: atomic operations executed
  uint32_t* thread_simd;      // per thread: SIMD collectives called
  uint32_t* thread_writes;    // per thread: output elements changed (needs writer attribution)
  // Writer attribution (output_count == 0: off).  After each slice of a
  // thread's execution, every output is compared with its shadow copy; each
  // element that changed is credited to that thread.
  int32_t output_count;
  unsigned char** outputs;    // the output buffers
  unsigned char** shadows;    // a copy of each, as it was after the last slice
  uint64_t* output_bytes;
  uint32_t* element_bytes;
  int64_t** writers;          // per output element: the linear grid index of its last writer, or -1
};

struct Fiber {
  ucontext_t context;  // where the fiber starts (its stack and entry point)
  jmp_buf jump;        // where it resumes after waiting
  bool started;
  State state;
  ThreadIds ids;
  uint64_t grid_index;  // linear position in the grid, for the instruments
  char* stack;
  int simd_phase;
  int simd_site;      // the source line of the SIMD collective it waits at
  int barrier_flags;  // the mem_flags of the barrier it waits at
};

struct Launch {
  Fiber fibers[kMaxThreads];
  int count = 0;      // threads in the current group
  int current = -1;   // the fiber running now
  bool use_fibers = false;
  jmp_buf scheduler;  // where a fiber that waits or finishes returns to
  Body body = nullptr;
  void** buffers = nullptr;
  Instruments* instruments = nullptr;
  // threadgroup memory: one block per `threadgroup` declaration, shared by the group
  char* memory_block[kMaxDeclarations];
  char* memory_shadow[kMaxDeclarations];  // each block as it was when the current phase began
  size_t memory_bytes[kMaxDeclarations];
  size_t memory_used = 0;
  // SIMD collectives: each lane's value, double-buffered by the lane's phase
  unsigned char slots[2][kMaxThreads][kSlotBytes];
  uint32_t live_lanes[2][kMaxThreads / kSimdWidth];
  char message[512];
  bool failed = false;
  sigjmp_buf fault_jump;
};

static Launch* launch_state = nullptr;  // one kernel per translation unit (C++14: no inline variables)

inline void fail(const char* text) {
  Launch& launch = *launch_state;
  if (!launch.failed) {
    std::snprintf(launch.message, sizeof(launch.message), "%s", text);
    launch.failed = true;
  }
}

inline Fiber& me() { return launch_state->fibers[launch_state->current]; }

// Add one to this thread's entry of a per-thread counter (if it is recorded).
inline void count_for_me(uint32_t* per_thread) {
  if (per_thread != nullptr) per_thread[me().grid_index] += 1;
}

inline void count_atomic() {
  Instruments& instruments = *launch_state->instruments;
  instruments.atomics += 1;
  count_for_me(instruments.thread_atomics);
}

// Give control back to the scheduler until this thread is released.
inline void wait_in(State state) {
  Launch& launch = *launch_state;
  if (!launch.use_fibers) {
    fail("internal: a barrier or SIMD collective ran in a launch without fibers");
    return;
  }
  Fiber& fiber = me();
  fiber.state = state;
  if (_setjmp(fiber.jump) == 0) _longjmp(launch.scheduler, 1);
}

inline char* threadgroup_block(int declaration, size_t bytes) {
  Launch& launch = *launch_state;
  if (declaration >= kMaxDeclarations) {
    fail("too many threadgroup declarations for the emulation");
    std::abort();
  }
  if (launch.memory_block[declaration] == nullptr) {
    launch.memory_used += bytes;
    if (launch.memory_used > kThreadgroupMemoryLimit) {
      fail("threadgroup memory exceeds Apple GPUs' 32 KB limit");
    }
    char* block = static_cast<char*>(std::malloc(bytes));
    std::memset(block, 0xff, bytes);  // NaN for floats, -1 for integers: uninitialised reads show
    launch.memory_block[declaration] = block;
    launch.memory_shadow[declaration] = static_cast<char*>(std::malloc(bytes));
    std::memcpy(launch.memory_shadow[declaration], block, bytes);
    launch.memory_bytes[declaration] = bytes;
  }
  return launch.memory_block[declaration];
}

template <class Array>
Array* threadgroup_array(int declaration) {
  return reinterpret_cast<Array*>(threadgroup_block(declaration, sizeof(Array)));
}

// Credit every output element that changed since the last slice to thread `t`.
inline void attribute_writes(Launch& launch, int t) {
  Instruments& instruments = *launch.instruments;
  uint64_t writer = launch.fibers[t].grid_index;
  for (int k = 0; k < instruments.output_count; ++k) {
    unsigned char* now = instruments.outputs[k];
    unsigned char* before = instruments.shadows[k];
    size_t bytes = instruments.output_bytes[k], width = instruments.element_bytes[k];
    if (bytes == 0 || std::memcmp(now, before, bytes) == 0) continue;
    for (size_t start = 0; start < bytes; start += kCompareChunk) {  // width divides kCompareChunk
      size_t end = start + kCompareChunk < bytes ? start + kCompareChunk : bytes;
      if (std::memcmp(now + start, before + start, end - start) == 0) continue;
      for (size_t offset = start; offset < end; offset += width) {
        if (std::memcmp(now + offset, before + offset, width) == 0) continue;
        std::memcpy(before + offset, now + offset, width);
        instruments.writers[k][offset / width] = int64_t(writer);
        if (instruments.thread_writes != nullptr) instruments.thread_writes[writer] += 1;
      }
    }
  }
}

// A fiber runs one thread's body after another (slot `index` of every group of
// every launch in this library), parking between them, so it is started only once.
inline void fiber_main(int index) {
  for (;;) {
    Launch& launch = *launch_state;
    Fiber& fiber = launch.fibers[index];
    launch.body(fiber.ids, launch.buffers);
    fiber.state = State::done;
    if (_setjmp(fiber.jump) == 0) _longjmp(launch.scheduler, 1);
  }
}

inline uint32_t next_random(uint32_t& seed) {
  seed ^= seed << 13;
  seed ^= seed >> 17;
  seed ^= seed << 5;
  return seed;
}

// order: 0 forward, 1 reverse, 2 random (a new shuffle on every call)
template <class Index>
inline void make_order(Index* order, size_t count, int mode, uint32_t& seed) {
  for (size_t i = 0; i < count; ++i) order[i] = Index(mode == 1 ? count - 1 - i : i);
  if (mode == 2) {
    for (size_t i = count - 1; count > 1 && i > 0; --i) {
      size_t j = size_t(next_random(seed)) % (i + 1);
      Index held = order[i];
      order[i] = order[j];
      order[j] = held;
    }
  }
}

// On a GPU a SIMD collective reduces over the lanes active at *that* call: lanes of one
// group waiting at different calls (divergent branches) are separate collectives, which
// the emulation cannot order as the hardware would, so it refuses them.  Calls are told
// apart by source line (two calls on one line are not).
inline bool same_simd_site(Launch& launch, int first, int last) {
  int site = -1;
  for (int t = first; t < last; ++t) {
    const Fiber& fiber = launch.fibers[t];
    if (fiber.state != State::at_simd) continue;
    if (site >= 0 && fiber.simd_site != site) {
      char text[256];
      std::snprintf(text, sizeof(text),
                    "divergent SIMD collectives: lanes of one SIMD group wait at collectives on lines %d and %d of "
                    "the kernel's text (as MLX writes it: verbose=True prints it); on a GPU each call would "
                    "reduce over its own branch's active lanes",
                    site - kTextFirstLine + 1, fiber.simd_site - kTextFirstLine + 1);
      fail(text);
      return false;
    }
    site = fiber.simd_site;
  }
  return true;
}

// A barrier orders threadgroup memory only if its flags say so (mem_flags::mem_threadgroup);
// with mem_none it orders execution alone, and threadgroup writes made before it need not be
// visible to the other threads after it.  The emulation's memory is always coherent, so it
// refuses such a barrier after any threadgroup write of the phase it closes (also where each
// thread would read back only its own writes, which a GPU allows), then starts the next phase.
inline bool barrier_orders_threadgroup_writes(Launch& launch) {
  bool orders = true;
  for (int t = 0; t < launch.count; ++t) {
    orders &= (launch.fibers[t].barrier_flags & int(metal::mem_flags::mem_threadgroup)) != 0;
  }
  bool wrote = false;
  for (int d = 0; d < kMaxDeclarations; ++d) {
    if (launch.memory_block[d] == nullptr) continue;
    wrote |= std::memcmp(launch.memory_block[d], launch.memory_shadow[d], launch.memory_bytes[d]) != 0;
    std::memcpy(launch.memory_shadow[d], launch.memory_block[d], launch.memory_bytes[d]);
  }
  if (wrote && !orders) {
    fail("threadgroup_barrier without mem_flags::mem_threadgroup after threads wrote threadgroup memory: "
         "on a GPU it orders execution only, and the other threads need not see those writes after it");
    return false;
  }
  return true;
}

// Release whatever can be released; returns false on deadlock or divergence.
inline bool release_waiting(Launch& launch) {
  Instruments& instruments = *launch.instruments;
  int groups = (launch.count + kSimdWidth - 1) / kSimdWidth;
  bool released = false;
  for (int group = 0; group < groups; ++group) {
    int first = group * kSimdWidth;
    int last = first + kSimdWidth < launch.count ? first + kSimdWidth : launch.count;
    bool all_arrived = true, any_arrived = false;
    uint32_t live = 0;
    for (int t = first; t < last; ++t) {
      State state = launch.fibers[t].state;
      if (state == State::done) continue;
      live |= 1u << (t - first);
      if (state == State::at_simd) any_arrived = true; else all_arrived = false;
    }
    if (any_arrived && all_arrived) {
      if (!same_simd_site(launch, first, last)) return false;
      for (int t = first; t < last; ++t) {
        Fiber& fiber = launch.fibers[t];
        if (fiber.state == State::at_simd) {
          launch.live_lanes[fiber.simd_phase & 1][group] = live;
          fiber.state = State::ready;
        }
      }
      instruments.simd_collectives += 1;
      released = true;
    }
  }
  if (released) return true;
  int at_barrier = 0, done = 0;
  for (int t = 0; t < launch.count; ++t) {
    if (launch.fibers[t].state == State::at_barrier) ++at_barrier;
    if (launch.fibers[t].state == State::done) ++done;
  }
  if (at_barrier > 0 && at_barrier + done == launch.count) {
    if (done > 0) {
      fail("threadgroup_barrier not reached by every thread of the group (some returned before it)");
      return false;
    }
    if (!barrier_orders_threadgroup_writes(launch)) return false;
    for (int t = 0; t < launch.count; ++t) launch.fibers[t].state = State::ready;
    instruments.barriers += 1;
    return true;
  }
  fail("deadlock: threads wait at different barriers or SIMD collectives (divergent control flow)");
  return false;
}

// Run thread t until it finishes or waits, then credit its writes.
inline void run_slice(Launch& launch, int t) {
  launch.current = t;
  if (launch.use_fibers) {
    // _setjmp/_longjmp do not save the signal mask, so a switch makes no system
    // call (swapcontext makes two); setcontext starts a fiber, once.
    Fiber& fiber = launch.fibers[t];
    if (_setjmp(launch.scheduler) == 0) {
      if (fiber.started) _longjmp(fiber.jump, 1);
      fiber.started = true;
      setcontext(&fiber.context);
    }
  } else {
    launch.body(launch.fibers[t].ids, launch.buffers);
  }
  if (launch.instruments->output_count > 0) attribute_writes(launch, t);
}

inline void run_group(Launch& launch, int mode, uint32_t& seed) {
  static int order[kMaxThreads];
  if (!launch.use_fibers) {
    make_order(order, size_t(launch.count), mode, seed);
    for (int k = 0; k < launch.count && !launch.failed; ++k) run_slice(launch, order[k]);
    return;
  }
  for (int t = 0; t < launch.count; ++t) {
    Fiber& fiber = launch.fibers[t];
    fiber.state = State::ready;
    fiber.simd_phase = 0;
    if (fiber.started) continue;  // parked at the end of its last thread: resuming runs the next
    if (fiber.stack == nullptr) fiber.stack = static_cast<char*>(std::malloc(kStackSize));
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fiber.stack;
    fiber.context.uc_stack.ss_size = kStackSize;
    fiber.context.uc_link = nullptr;  // fiber_main never returns
    makecontext(&fiber.context, reinterpret_cast<void (*)()>(fiber_main), 1, t);
  }
  for (;;) {
    make_order(order, size_t(launch.count), mode, seed);
    bool all_done = true;
    for (int k = 0; k < launch.count && !launch.failed; ++k) {
      if (launch.fibers[order[k]].state == State::ready) run_slice(launch, order[k]);
    }
    if (launch.failed) return;
    for (int t = 0; t < launch.count; ++t) all_done &= launch.fibers[t].state == State::done;
    if (all_done) return;
    bool any_ready = false;
    for (int t = 0; t < launch.count; ++t) any_ready |= launch.fibers[t].state == State::ready;
    if (!any_ready && !release_waiting(launch)) return;
  }
}

inline void on_fault(int) { siglongjmp(launch_state->fault_jump, 1); }

inline void free_threadgroup_memory(Launch& launch) {
  for (int d = 0; d < kMaxDeclarations; ++d) {
    std::free(launch.memory_block[d]);
    std::free(launch.memory_shadow[d]);
    launch.memory_block[d] = launch.memory_shadow[d] = nullptr;
  }
  launch.memory_used = 0;
}

// Set up the ids of the threads of the group at `position` that lie inside the grid.
inline void place_group(Launch& launch, uint3 position, const unsigned* grid, const unsigned* group,
                        const unsigned* groups) {
  uint3 actual;
  actual.x = grid[0] - position.x * group[0] < group[0] ? grid[0] - position.x * group[0] : group[0];
  actual.y = grid[1] - position.y * group[1] < group[1] ? grid[1] - position.y * group[1] : group[1];
  actual.z = grid[2] - position.z * group[2] < group[2] ? grid[2] - position.z * group[2] : group[2];
  launch.count = int(actual.x * actual.y * actual.z);
  int t = 0;
  for (uint z = 0; z < actual.z; ++z)
    for (uint y = 0; y < actual.y; ++y)
      for (uint x = 0; x < actual.x; ++x, ++t) {
        Fiber& fiber = launch.fibers[t];
        ThreadIds& ids = fiber.ids;
        ids.thread_position_in_threadgroup = {x, y, z};
        ids.threadgroup_position_in_grid = position;
        ids.thread_position_in_grid = {position.x * group[0] + x, position.y * group[1] + y,
                                       position.z * group[2] + z};
        ids.threads_per_threadgroup = actual;
        ids.threads_per_grid = {grid[0], grid[1], grid[2]};
        ids.threadgroups_per_grid = {groups[0], groups[1], groups[2]};
        ids.thread_index_in_threadgroup = uint(t);
        ids.thread_index_in_simdgroup = uint(t % kSimdWidth);
        ids.simdgroup_index_in_threadgroup = uint(t / kSimdWidth);
        ids.threads_per_simdgroup = kSimdWidth;
        const uint3& p = ids.thread_position_in_grid;
        fiber.grid_index = p.x + uint64_t(grid[0]) * (p.y + uint64_t(grid[1]) * p.z);
      }
}

// Run the whole grid.  Returns 0, or 1 with a message.
inline int launch(Body body, void** buffers, const unsigned* grid, const unsigned* group_size, int mode,
                  unsigned seed, bool use_fibers, Instruments* instruments, char* message, int message_size) {
  static Launch state;
  Launch& launch = state;
  launch_state = &launch;
  launch.body = body;
  launch.buffers = buffers;
  launch.use_fibers = use_fibers;
  launch.instruments = instruments;
  launch.failed = false;
  launch.message[0] = 0;
  uint32_t random_state = seed * 2654435761u + 1u;
  unsigned group[3], groups[3];
  for (int k = 0; k < 3; ++k) {
    group[k] = group_size[k] < grid[k] ? group_size[k] : grid[k];  // as MLX: min(threadgroup, grid)
    groups[k] = group[k] ? (grid[k] + group[k] - 1) / group[k] : 0;
  }
  if (size_t(group[0]) * group[1] * group[2] > size_t(kMaxThreads)) {
    std::snprintf(message, message_size, "threadgroup of %u threads exceeds Metal's 1024",
                  group[0] * group[1] * group[2]);
    return 1;
  }
  size_t group_count = size_t(groups[0]) * groups[1] * groups[2];
  uint64_t* group_order = static_cast<uint64_t*>(std::malloc((group_count ? group_count : 1) * sizeof(uint64_t)));
  make_order(group_order, group_count, mode, random_state);
  struct sigaction fault_action, old_segv, old_bus;
  std::memset(&fault_action, 0, sizeof(fault_action));
  fault_action.sa_handler = on_fault;
  sigaction(SIGSEGV, &fault_action, &old_segv);
  sigaction(SIGBUS, &fault_action, &old_bus);
  if (sigsetjmp(launch.fault_jump, 1) != 0) {
    fail("memory fault: the kernel read or wrote far outside its buffers");
  } else {
    for (size_t k = 0; k < group_count && !launch.failed; ++k) {
      uint64_t linear = group_order[k];
      uint3 position = {uint(linear % groups[0]), uint(linear / groups[0] % groups[1]),
                        uint(linear / groups[0] / groups[1])};
      place_group(launch, position, grid, group, groups);
      run_group(launch, mode, random_state);
      free_threadgroup_memory(launch);
    }
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  std::free(group_order);
  if (launch.failed) {
    free_threadgroup_memory(launch);
    // Fibers may be parked in the middle of a body: start them afresh next time.
    for (int t = 0; t < kMaxThreads; ++t) launch.fibers[t].started = false;
    std::snprintf(message, message_size, "%s", launch.message);
    return 1;
  }
  return 0;
}

}  // namespace emu

// ---------------------------------------------------------------- namespace metal

namespace metal {

inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

// Every thread of the group must arrive before any goes on.
inline void threadgroup_barrier(mem_flags flags) {
  emu::me().barrier_flags = int(flags);
  emu::Instruments& instruments = *emu::launch_state->instruments;
  instruments.barrier_waits += 1;
  emu::count_for_me(instruments.thread_barriers);
  emu::wait_in(emu::State::at_barrier);
}

// -- SIMD-group collectives: every live lane of the 32-wide group must arrive.

template <class T>
inline T lane_value(int phase, int thread) {
  T value;
  std::memcpy(&value, emu::launch_state->slots[phase][thread], sizeof(T));
  return value;
}

// Publish this lane's value and wait for the rest of its SIMD group.
// Returns the phase whose slots hold the group's values.
template <class T>
inline int simd_exchange(T value, int site) {
  static_assert(sizeof(T) <= emu::kSlotBytes, "SIMD value too large for the emulation");
  emu::Fiber& fiber = emu::me();
  fiber.simd_site = site;
  emu::count_for_me(emu::launch_state->instruments->thread_simd);
  int phase = fiber.simd_phase & 1;
  std::memcpy(emu::launch_state->slots[phase][fiber.ids.thread_index_in_threadgroup], &value, sizeof(T));
  emu::wait_in(emu::State::at_simd);
  fiber.simd_phase += 1;
  return phase;
}

inline uint32_t live_mask(int phase) {
  return emu::launch_state->live_lanes[phase][emu::me().ids.simdgroup_index_in_threadgroup];
}

inline int first_thread_of_my_simdgroup() {
  return int(emu::me().ids.simdgroup_index_in_threadgroup) * emu::kSimdWidth;
}

template <class T, class Combine>
inline T simd_reduce(T value, Combine combine, int site) {
  int phase = simd_exchange(value, site);
  uint32_t live = live_mask(phase);
  int first = first_thread_of_my_simdgroup();
  bool started = false;
  T result = value;
  for (int lane = 0; lane < emu::kSimdWidth; ++lane) {
    if (!(live & (1u << lane))) continue;
    T other = lane_value<T>(phase, first + lane);
    result = started ? combine(result, other) : other;
    started = true;
  }
  return result;
}

template <class T>
inline T simd_sum(T value, int site = __builtin_LINE()) {
  return simd_reduce(value, [](T a, T b) { return T(a + b); }, site);
}
template <class T>
inline T simd_max(T value, int site = __builtin_LINE()) {
  return simd_reduce(value, [](T a, T b) { return a > b ? a : b; }, site);
}
template <class T>
inline T simd_min(T value, int site = __builtin_LINE()) {
  return simd_reduce(value, [](T a, T b) { return a < b ? a : b; }, site);
}

// The value of lane `source` (undefined, here NaN bytes, if that lane is inactive).
template <class T>
inline T read_lane(int phase, int source, T own) {
  if (source < 0 || source >= emu::kSimdWidth) return own;
  if (!(live_mask(phase) & (1u << source))) {
    T garbage;
    std::memset(&garbage, 0xff, sizeof(T));
    return garbage;
  }
  return lane_value<T>(phase, first_thread_of_my_simdgroup() + source);
}

template <class T>
inline T simd_shuffle(T value, unsigned short lane, int site = __builtin_LINE()) {
  int phase = simd_exchange(value, site);
  return read_lane(phase, int(lane), value);
}
template <class T>
inline T simd_broadcast(T value, unsigned short lane, int site = __builtin_LINE()) {
  return simd_shuffle(value, lane, site);
}
template <class T>
inline T simd_shuffle_down(T value, unsigned short delta, int site = __builtin_LINE()) {
  int phase = simd_exchange(value, site);
  return read_lane(phase, int(emu::me().ids.thread_index_in_simdgroup) + int(delta), value);
}
template <class T>
inline T simd_shuffle_up(T value, unsigned short delta, int site = __builtin_LINE()) {
  int phase = simd_exchange(value, site);
  int lane = int(emu::me().ids.thread_index_in_simdgroup) - int(delta);
  return lane < 0 ? value : read_lane(phase, lane, value);
}
template <class T>
inline T simd_shuffle_xor(T value, unsigned short mask, int site = __builtin_LINE()) {
  int phase = simd_exchange(value, site);
  return read_lane(phase, int(emu::me().ids.thread_index_in_simdgroup ^ mask), value);
}

// -- atomics (the threads run on one CPU thread, so plain read-modify-write is atomic).
// Each operation is counted in the launch's instruments.

enum memory_order { memory_order_relaxed };

template <class T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;

template <class T, class U>
inline T atomic_fetch_add_explicit(atomic<T>* object, U operand, memory_order) {
  emu::count_atomic();
  T old = object->value;
  object->value = T(old + T(operand));
  return old;
}
template <class T, class U>
inline T atomic_fetch_max_explicit(atomic<T>* object, U operand, memory_order) {
  emu::count_atomic();
  T old = object->value;
  object->value = old > T(operand) ? old : T(operand);
  return old;
}
template <class T>
inline T atomic_load_explicit(atomic<T>* object, memory_order) {
  emu::count_atomic();
  return object->value;
}
template <class T, class U>
inline void atomic_store_explicit(atomic<T>* object, U operand, memory_order) {
  emu::count_atomic();
  object->value = T(operand);
}

// -- math, in float (half and bfloat convert on the way in and out)

inline float exp(float x) { return ::expf(x); }
inline float log(float x) { return ::logf(x); }
inline float tanh(float x) { return ::tanhf(x); }
inline float sqrt(float x) { return ::sqrtf(x); }
inline float rsqrt(float x) { return 1.0f / ::sqrtf(x); }
inline float abs(float x) { return ::fabsf(x); }
inline float fabs(float x) { return ::fabsf(x); }
inline float pow(float x, float y) { return ::powf(x, y); }
inline float powr(float x, float y) { return ::powf(x, y); }
inline float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
inline float floor(float x) { return ::floorf(x); }
inline float ceil(float x) { return ::ceilf(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline float max(float a, float b) { return ::fmaxf(a, b); }
inline float min(float a, float b) { return ::fminf(a, b); }
inline float fmax(float a, float b) { return ::fmaxf(a, b); }
inline float fmin(float a, float b) { return ::fminf(a, b); }
inline float clamp(float x, float low, float high) { return ::fminf(::fmaxf(x, low), high); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
template <class T>
inline T select(T if_false, T if_true, bool condition) {
  return condition ? if_true : if_false;
}

// precise:: and fast:: name the same functions (the emulation computes in IEEE float either way).
namespace precise {
using metal::exp;
using metal::log;
using metal::pow;
using metal::sqrt;
using metal::tanh;
}  // namespace precise

namespace fast {
using metal::exp;
using metal::log;
using metal::pow;
using metal::sqrt;
using metal::tanh;
}  // namespace fast

}  // namespace metal

using namespace metal;

// MSL's address spaces: one flat memory here.  (Defined after the system
// headers, which use some of these words.)
#define device
#define constant
#define thread
#define threadgroup
#define kernel
