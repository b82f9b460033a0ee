// cpu_loop.h: the one MLX primitive class behind seqlib's CPU operations.
//
// Each of seqlib's C++ operations (a recurrent time loop in recurrent_cpu.cpp, a bag pooling in
// bags_cpu.cpp) is a plain function, a Runner, that reads the primitive's inputs and fills its
// outputs.  CpuLoop<Params> wraps a Runner and its parameters as an mlx::core::Primitive: it
// allocates the outputs, registers the arrays with the CPU stream's command encoder and runs the
// Runner there, so MLX schedules it like any of its own CPU operations.  make_loop builds the
// output arrays of one call.  mx.vmap runs the loop once per mapped index; gradients are the
// callers' (an mx.custom_function whose backward is another loop); mx.jvp, second derivatives and
// gradients of a vmap raise a ValueError that says so.  run_parallel runs a loop's threads.
#pragma once

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfenv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <semaphore>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace seqlib_cpu {

namespace mx = mlx::core;

// Ask Linux to back a large new buffer with 2 MB pages (transparent huge pages, as NumPy does for
// its large arrays): its first touch then takes one page fault per 2 MB instead of one per 4 KB
// (about 0.7 ms per MB of 4 KB faults in a virtual machine), and random reads of it miss the TLB
// far less.  Only the whole 2 MB pages inside the buffer are advised; it changes no data.
inline void advise_huge_pages(char* data, size_t bytes) {
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  if (bytes < 4 * kHugePage) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice: errors ignored
}

template <class Params>
class CpuLoop : public mx::Primitive {
 public:
  using Runner = void (*)(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Params& params);
  // The vector-Jacobian product, as MLX's Primitive::vjp: one array per entry of argnums.
  using Vjp = std::vector<mx::array> (*)(const Params& params, const std::vector<mx::array>& primals,
                                         const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                         const std::vector<mx::array>& outputs);
  // The outputs' shapes for inputs of other shapes (mx.compile(shapeless=True)), for a loop whose outputs
  // follow its inputs' shapes alone, given also the shapes it was built for (a rule may refuse a change, with
  // an std::invalid_argument); nullptr: the loop is fixed by what it was built for.
  using ShapeRule = std::vector<mx::Shape> (*)(const std::vector<mx::array>& inputs,
                                               const std::vector<mx::Shape>& built_for);

  CpuLoop(mx::Stream stream, const char* name, Runner runner, Params params, std::vector<mx::Shape> shapes,
          std::vector<mx::Dtype> dtypes, std::vector<mx::Shape> input_shapes, Vjp vjp = nullptr,
          ShapeRule shape_rule = nullptr)
      : mx::Primitive(stream), name_(name), runner_(runner), params_(std::move(params)), shapes_(std::move(shapes)),
        dtypes_(std::move(dtypes)), input_shapes_(std::move(input_shapes)), vjp_(vjp), shape_rule_(shape_rule) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      advise_huge_pages(out.data<char>(), out.nbytes());
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins, outs;
    for (auto& in : inputs) {
      encoder.set_input_array(in);
      ins.push_back(mx::array::unsafe_weak_copy(in));
    }
    for (auto& out : outputs) {
      encoder.set_output_array(out);
      outs.push_back(mx::array::unsafe_weak_copy(out));
    }
    encoder.dispatch([ins, outs, runner = runner_, params = params_]() mutable { runner(ins, outs, params); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU only");
  }

  const char* name() const override { return name_; }

  // mx.vmap: the loop once per index of the mapped axis, the results stacked along a new first axis.
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override {
    int size = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (axes[i] >= 0) size = inputs[i].shape(axes[i]);
    }
    std::vector<std::vector<mx::array>> results(shapes_.size());
    for (int k = 0; k < size; ++k) {
      std::vector<mx::array> slice;
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (axes[i] < 0) {
          slice.push_back(inputs[i]);
          continue;
        }
        mx::Shape start(inputs[i].ndim(), 0), stop = inputs[i].shape();
        start[axes[i]] = k, stop[axes[i]] = k + 1;  // a slice, not a take, which refuses empty arrays
        const mx::array one = mx::squeeze(mx::slice(inputs[i], start, stop, stream()), axes[i], stream());
        slice.push_back(mx::contiguous(one, false, stream()));
      }
      std::vector<mx::Shape> slice_shapes;
      for (auto& array : slice) slice_shapes.push_back(array.shape());
      auto loop = std::make_shared<CpuLoop>(stream(), name_, runner_, params_, shapes_, dtypes_, slice_shapes, vjp_,
                                            shape_rule_);
      auto outputs = mx::array::make_arrays(shapes_, dtypes_, loop, slice);
      for (size_t j = 0; j < outputs.size(); ++j) results[j].push_back(outputs[j]);
    }
    std::vector<mx::array> stacked;
    for (size_t j = 0; j < results.size(); ++j) {  // an empty mapped axis: no loop, empty outputs
      if (size == 0) {
        mx::Shape shape = shapes_[j];
        shape.insert(shape.begin(), 0);
        stacked.push_back(mx::zeros(shape, dtypes_[j], stream()));
      } else {
        stacked.push_back(mx::stack(results[j], 0, stream()));
      }
    }
    return {stacked, std::vector<int>(stacked.size(), 0)};
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                             const std::vector<int>&) override {
    throw std::invalid_argument(unsupported("mx.jvp"));  // forward mode: not written
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override {
    if (vjp_ == nullptr) {  // a backward loop (its gradient is a second derivative), a check, an optimizer's update
      throw std::invalid_argument(std::string(name_) + " (one of seqlib's C++ CPU primitives) has no gradient: a second "
                                  "derivative of a layer, or a gradient through an optimizer's update, is not supported "
                                  "there; set SEQLIB_NATIVE=0 to run the MLX-ops path, which supports it");
    }
    return vjp_(params_, primals, cotangents, argnums, outputs);
  }

  // mx.compile(shapeless=True) asks again when the inputs' shapes change: a loop with a shape rule follows
  // them; the others' loops are fixed by what they were built for (batch_sizes, bags), so they say so.
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    bool same = inputs.size() == input_shapes_.size();
    for (size_t i = 0; same && i < inputs.size(); ++i) same = inputs[i].shape() == input_shapes_[i];
    if (same) return shapes_;
    if (shape_rule_ != nullptr) return shape_rule_(inputs, input_shapes_);
    throw std::invalid_argument(std::string(name_) + ": its loop was built for its inputs' shapes (the steps or bags "
                                "are fixed when it is made), so mx.compile(..., shapeless=True) cannot change them; "
                                "compile without shapeless=True");
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuLoop&>(other);
    return runner_ == o.runner_ && vjp_ == o.vjp_ && params_ == o.params_ && shapes_ == o.shapes_;
  }

 private:
  std::string unsupported(const char* what) const {
    return std::string(what) + " through seqlib's C++ CPU primitive " + name_ +
           " is not supported (gradients, mx.vmap and their compositions are); set SEQLIB_NATIVE=0 "
           "to run the MLX-ops path, which supports it";
  }

  const char* name_;
  Runner runner_;
  Params params_;
  std::vector<mx::Shape> shapes_;  // of the outputs (they follow from Params and the inputs' shapes)
  std::vector<mx::Dtype> dtypes_;
  std::vector<mx::Shape> input_shapes_;  // what the loop was built for
  Vjp vjp_;               // nullptr: no gradient (a backward loop, a check)
  ShapeRule shape_rule_;  // nullptr: fixed shapes (a time loop, bags)
};

inline mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

// Part `part` of `parts` of the range [first, end), the parts as even as they can be.
template <class Int>
std::pair<Int, Int> share_of(Int first, Int end, Int part, Int parts) {
  return {first + (end - first) * part / parts, first + (end - first) * (part + 1) / parts};
}

// A spinning thread's hint to the core (x86 pause, Arm yield): let the other hyperthread run, save power.
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A core's L2 in bytes, as the C library reports it (1 MB where it does not).
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)  // glibc's; macOS has none
    const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long reported = 0;
#endif
    return reported > 0 ? int64_t{reported} : int64_t{1} << 20;
  }();
  return bytes;
}

// Threads a loop may use: the CPUs this process may run on, at most OMP_NUM_THREADS where that is set.
inline int thread_budget() {
  static const int budget = [] {
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    if (const char* limit = std::getenv("OMP_NUM_THREADS")) {
      const int wanted = std::atoi(limit);
      if (wanted > 0) cpus = std::min(cpus, wanted);
    }
    return std::max(cpus, 1);
  }();
  return budget;
}

// Threaded products the BLAS shim (seqlib/_blas_shim.c, loaded before this library) has started so far; 0
// where it is not loaded.
extern "C" __attribute__((weak, visibility("default"))) int64_t seqlib_blas_shim_threaded_calls(void);
inline int64_t threaded_blas_calls() {
  return seqlib_blas_shim_threaded_calls != nullptr ? seqlib_blas_shim_threaded_calls() : 0;
}

// Threads kept between calls, so that a loop's team costs a wake-up per thread (a system call each) instead
// of starting one: 16 threads started and joined took 340 us on a 16-core Sapphire Rapids virtual machine.
// One team at a time: a caller that finds them taken (a loop on another MLX stream, or one inside a loop)
// starts its own threads, as does a process forked from one that had workers.  Each part runs in the
// caller's floating-point environment (rounding, flush-to-zero), as a thread started by it would.  Each
// worker sleeps on its own semaphore (a futex) and is never destroyed: at exit it is still asleep.
//
// After a part a worker first watches for its next job for kWatchTime, so that calls in quick succession (a
// streamed step, hundreds of microseconds apart) find it awake on its own core: a sleeping worker, woken
// again at every step, was often woken onto the caller's core on a 2-core virtual machine, and an LSTMCell
// step at H = 512 (two threads) took 363 us a step, 225 with a watch (50 steps after an idle process,
// interleaved; torch on two threads: 267).  That watch was meant to last 90 us but lasted 7.4 ms: it polled
// the semaphore's try_acquire, which in libstdc++ spins and yields inside, 0.9 us a failed call.  It now
// reads a count of posted jobs, for at most kWatchTime.  50 streamed LSTMCell steps at H = 512 on the same
// machine, microseconds a step, three alternated processes each: the 7.4 ms watch 371, 464, 376; 250 us
// 365, 388, 392; 500 us 293, 306, 400; 1 ms 294, 376, 401.  The watch ends early where a product starts on
// OpenBLAS's threads (the BLAS shim counts them: threaded_blas_calls), which want every core: on a 16-core
// Sapphire Rapids virtual machine, workers still watching when a layer's gradient handed over to its
// weight-gradient products made that gradient slower and erratic.  Medians of 7, five alternated runs each,
// the 7.4 ms watch / none: LSTM at (T, B, D, H) = (35, 20, 650, 650) 16.9-46.4 / 17.1-20.7 ms, GRU at
// (200, 64, 128, 128) 27.5-97.7 / 23.4-26.6, GRU at (100, 32, 256, 512) 46.2-53.1 / 34.6-40.1; forwards
// alike; but 50 streamed LSTMCell steps at H = 512, 4.0-5.2 / 4.9-7.0 ms.
//
// A worker is kept off its caller's CPU (keep_off).  After the process was idle (as the benchmark harness times each
// call), the kernel often woke the worker onto the caller's CPU on a 2-core virtual machine, though the other CPU
// was idle, and the team of two then took turns on one CPU.  A call of the one-sequence LSTM below had about 60
// involuntary context switches; timed after the harness's settle, 2-core Sapphire Rapids, (T, B, D, H) = (50, 1,
// 64, 256) forward, LSTM 3.2-3.3 ms, GRU 3.0-3.2 (0.5-0.6 called back to back).  The worker then moved itself off
// once it ran (1.26-1.42 and 1.07-1.20 ms), but on a 2-core Zen 5 virtual machine the woken worker often did not run
// until the caller's own part had ended: a sparse EmbeddingBag step (seqlib.sparse, 1M x 128 table, 84,570
// entries) ran its 1.4 ms forward on the caller alone in 35-42 of 80 steps.  So before it posts a job to a sleeping
// worker, the caller narrows the worker's CPUs to all but its own, and the worker restores them as it takes the
// job: 0-1 steps of 80 had a worker start late, and evaluating the step took 3.89-4.02 ms at the median against
// 4.19-4.50.  The same holds a watching worker that the kernel moved onto the caller's CPU (the caller is MLX's
// stream thread, which MLX's own wake-ups move): narrowing the CPUs of a thread that waits to run moves it at once.
//
// A watching worker yields its CPU (sched_yield) every kCheckEvery pauses, to a thread of the process that the kernel
// woke onto it: on a 2-core Zen 5 virtual machine the Python thread, between streamed steps, often landed on the
// watching worker's CPU and waited there for a scheduler slice while the other CPU idled.  50 streamed steps at H =
// 512, each after the harness's settle, medians of 11 streams, us a step, eight processes without / five with:
// LSTMCell 102-471 / 140-143, its 8-bit form 101-459 / 113-115, GRUCell 106-396 / 108-113; layers' forward and
// forward+backward at the shapes, interleaved builds, 0.96-1.07 (noise).
//
// The caller waits for the workers' parts by watching their count for at most kWatchTime after its own part
// (yielding as the workers do), then on the semaphore.  A caller that slept there was woken by the last worker, and
// the kernel places a woken thread on its waker's CPU: the Python thread moved onto the worker's CPU, where the worker
// then watched, and the two took turns on one CPU at every later step (two involuntary context switches a step)
// while the other idled.  Streams of 50 steps at H = 512, each after the harness's settle, 2-core Zen 5 virtual
// machine, 16 interleaved streams, us a step: LSTMCell 133-135 -> 83, its 8-bit form 81-91 -> 61-66.  The watch
// once counted from the post, so a part longer than kWatchTime (the sparse step's 1.4 ms forward) left none: the
// caller slept whenever a worker finished after it, and woke on that worker's CPU for the step's backward.  A caller
// that did sleep now moves back to the CPU it posted from (return_to).
class Workers {
 public:
  // A type-erased body(part).
  struct Job {
    void (*call)(void* body, int part);
    void* body;
  };

  // This process's workers (new ones in a forked child: the parent's threads are not there).
  static Workers& get() {
    static std::once_flag forks;
    std::call_once(forks, [] { pthread_atfork(nullptr, nullptr, [] { current().store(nullptr); }); });
    Workers* workers = current().load(std::memory_order_acquire);
    if (workers == nullptr) {
      auto* fresh = new Workers;  // never deleted: detached workers may still wait on it
      if (current().compare_exchange_strong(workers, fresh, std::memory_order_acq_rel)) {
        workers = fresh;
      } else {
        delete fresh;  // another thread made them first (workers now holds them); nothing waits on this one
      }
    }
    return *workers;
  }

  // job.call(job.body, part) for parts 0 .. parts - 1 at once, part 0 on this thread; false (nothing run)
  // where the workers are taken.
  bool try_run(int parts, Job job) {
    if (parts < 2 || taken_.exchange(true, std::memory_order_acquire)) return false;
    struct Release {
      std::atomic<bool>& taken;
      ~Release() { taken.store(false, std::memory_order_release); }
    } release{taken_};
    while (static_cast<int>(sleepers_.size()) < parts - 1) {
      auto sleeper = std::make_unique<Sleeper>();
      std::thread([this, sleeper = sleeper.get(), part = static_cast<int>(sleepers_.size()) + 1] {
        sleeper->tid.store(static_cast<pid_t>(syscall(SYS_gettid)), std::memory_order_relaxed);
        for (unsigned taken = 0;; ++taken) {
          const int64_t blas_calls = threaded_blas_calls();
          const auto watch_end = std::chrono::steady_clock::now() + kWatchTime;
          watching_.fetch_add(1, std::memory_order_relaxed);
          const bool watched = watch(  // whether the job came during the watch, not while the worker slept
              [&] { return sleeper->posted.load(std::memory_order_relaxed) != taken; },
              [&] {  // the watch is over, or a threaded product needs this core
                sleeper->cpu.store(sched_getcpu(), std::memory_order_relaxed);
                return std::chrono::steady_clock::now() > watch_end || threaded_blas_calls() != blas_calls;
              });
          watching_.fetch_sub(1, std::memory_order_relaxed);
          if (!watched) sleeper->cpu.store(-1, std::memory_order_relaxed);
          sleeper->wake.acquire();  // at once where the job was posted
          if (sleeper->kept_off) {  // the caller narrowed this thread's CPUs (keep_off): restore them
            sleeper->kept_off = false;
            sched_setaffinity(0, sizeof(sleeper->allowed), &sleeper->allowed);
          }
          sleeper->cpu.store(sched_getcpu(), std::memory_order_relaxed);
          fesetenv(&environment_);
          job_.call(job_.body, part);
          if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_.release();
        }
      }).detach();  // a worker exists before its semaphore is listed: a failed start lists none
      sleepers_.push_back(std::move(sleeper));
    }
    job_ = job;
    const int cpu = sched_getcpu();
    fegetenv(&environment_);
    running_.store(parts - 1, std::memory_order_relaxed);
    for (int part = 1; part < parts; ++part) {
      Sleeper& sleeper = *sleepers_[part - 1];
      const int at = sleeper.cpu.load(std::memory_order_relaxed);
      if (at < 0 || at == cpu) keep_off(sleeper, cpu);  // asleep, or on this thread's CPU
      sleeper.posted.fetch_add(1, std::memory_order_relaxed);
      sleeper.wake.release();  // publishes job_ to the worker
    }
    job.call(job.body, 0);
    const auto wait_end = std::chrono::steady_clock::now() + kWatchTime;  // see "The caller waits" above
    const bool watched = watch([&] { return running_.load(std::memory_order_acquire) == 0; },
                               [&] { return std::chrono::steady_clock::now() > wait_end; });
    done_.acquire();  // released by the last worker to finish: all their writes are visible here
    if (!watched) return_to(cpu);
    return true;
  }

  // Whether `count` workers would start a job at once, or soon: they watch for one (a job of theirs ended less than
  // kWatchTime ago), or ready() was last asked less than kWatchTime ago (calls in quick succession, which repay
  // waking them: the next finds them watching).  A short loop that finds them asleep runs on its own thread: see
  // team_of in recurrent_cpu.cpp.
  bool ready(int count) {
    const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    const int64_t before = last_asked_.exchange(now, std::memory_order_relaxed);
    return watching_.load(std::memory_order_relaxed) >= count ||
           std::chrono::steady_clock::duration(now - before) < kWatchTime;
  }

 private:
  struct Sleeper;

  // Spins (pausing) until done(), true; every kCheckEvery pauses asks give_up() and, where it says to, returns
  // done() then; else yields the CPU (sched_yield), to a thread of the process that the kernel woke onto it.
  template <class Done, class GiveUp>
  static bool watch(Done done, GiveUp give_up) {
    for (int spins = 1; !done(); ++spins) {
      if (spins % kCheckEvery == 0) {
        if (give_up()) return done();
        sched_yield();
      }
      spin_pause();
    }
    return true;
  }

  static std::atomic<Workers*>& current() {
    static std::atomic<Workers*> workers{nullptr};
    return workers;
  }

  // Narrows a worker's CPUs to those it may run on but `cpu` (the caller's), so that the kernel wakes it, or moves it,
  // elsewhere; the worker restores them as it takes its job.  Nothing where it may run on `cpu` alone.
  static void keep_off(Sleeper& sleeper, int cpu) {
    const pid_t tid = sleeper.tid.load(std::memory_order_relaxed);
    if (tid == 0 || cpu < 0 || cpu >= CPU_SETSIZE) return;
    if (sched_getaffinity(tid, sizeof(sleeper.allowed), &sleeper.allowed) != 0) return;
    if (!CPU_ISSET(cpu, &sleeper.allowed) || CPU_COUNT(&sleeper.allowed) < 2) return;
    cpu_set_t others = sleeper.allowed;
    CPU_CLR(cpu, &others);
    sleeper.kept_off = sched_setaffinity(tid, sizeof(others), &others) == 0;  // the post publishes it
  }

  // A caller woken from its wait onto another CPU (its waker's) moves back to `cpu`, the one it posted from and left
  // idle: its affinity narrowed to that CPU (the kernel moves it at once), then restored.
  static void return_to(int cpu) {
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getcpu() == cpu) return;
    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || !CPU_ISSET(cpu, &allowed)) return;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof(one), &one) == 0) sched_setaffinity(0, sizeof(allowed), &allowed);
  }

  std::atomic<int> watching_{0};  // workers now in their watch
  std::atomic<int64_t> last_asked_{std::numeric_limits<int64_t>::min() / 2};  // when ready() was (steady clock)
  static constexpr std::chrono::microseconds kWatchTime{1000};
  static constexpr int kCheckEvery = 64;  // pauses between looks at the clock and the BLAS shim's count
  std::atomic<bool> taken_{false};  // a flag, not a mutex: a part that runs a loop of its own may ask again
  // A worker's semaphore and the count of jobs posted to it, which its watch reads (not the semaphore).
  struct alignas(64) Sleeper {
    std::binary_semaphore wake{0};
    std::atomic<unsigned> posted{0};
    std::atomic<int> cpu{-1};  // the CPU the worker last ran on; -1 while it sleeps
    std::atomic<pid_t> tid{0};  // the worker's thread id, once it runs
    cpu_set_t allowed;  // the worker's CPUs before keep_off narrowed them
    bool kept_off = false;  // set by the caller before a post, cleared by the worker after it
  };
  std::vector<std::unique_ptr<Sleeper>> sleepers_;  // worker i runs part i + 1
  Job job_{};
  fenv_t environment_{};  // the caller's floating-point environment, which each part runs in
  std::atomic<int> running_{0};
  std::binary_semaphore done_{0};
};

// body(part) for part = 0 .. parts - 1, all at once (a part may wait for the others, as at a barrier), part 0
// on this thread, the others on Workers (or, where those are taken, threads started for this call).  Returns
// when every part has.  body must not throw: as in a std::thread, an exception would end the process.
template <class Body>
void run_parallel(int parts, Body&& body) {
  if (parts <= 1) {
    body(0);
    return;
  }
  using Function = std::remove_reference_t<Body>;
  const Workers::Job job{[](void* function, int part) { (*static_cast<Function*>(function))(part); },
                         const_cast<void*>(static_cast<const void*>(&body))};
  if (Workers::get().try_run(parts, job)) return;
  std::vector<std::thread> started;
  for (int part = 1; part < parts; ++part) started.emplace_back([&body, part] { body(part); });
  body(0);
  for (auto& thread : started) thread.join();
}

// Run body(begin, end) over [0, count) in chunks that threads take in turn from a shared
// counter, so a thread slowed by another process (a busy core) takes fewer of them; `work`
// (about the floats touched) decides whether more threads than one are worth starting.  Each
// index is handled by one body call, whichever thread makes it.
template <class Body>
void parallel_for(int64_t count, int64_t work, Body body) {
  constexpr int64_t kWorkPerThread = 1 << 16;
  const int64_t threads = std::min<int64_t>({thread_budget(), count, std::max<int64_t>(work / kWorkPerThread, 1)});
  if (threads <= 1) {
    body(int64_t{0}, count);
    return;
  }
  const int64_t chunk = std::max<int64_t>(count / (threads * 8), 1);
  std::atomic<int64_t> next{0};
  auto take_chunks = [&] {
    for (int64_t begin = next.fetch_add(chunk); begin < count; begin = next.fetch_add(chunk)) {
      body(begin, std::min(begin + chunk, count));
    }
  };
  run_parallel(static_cast<int>(threads), [&](int) { take_chunks(); });
}

// The build's widest float vector, in GCC's vector extension (-march=native picks the instructions): loops that
// need no intrinsics (the bags' pooling, the losses) are written once for AVX-512, AVX and SSE.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float Floats __attribute__((vector_size(4 * kLanes)));

// A vector's unaligned load and store.
inline Floats load(const float* from) {
  Floats v;
  std::memcpy(&v, from, sizeof v);
  return v;
}
inline void store(float* to, Floats v) { std::memcpy(to, &v, sizeof v); }
// x in every lane.
inline Floats splat(float x) { return Floats{} + x; }

// Whether a loop writing `bytes` of output should write it past the caches (copy_streaming): where it outgrows the
// L2 of every thread that may write it, so that its lines would only evict what the loop reads, and each would be
// read from memory before it is written (a read for ownership), a third of the traffic of a copy.  Embedding's gather
// (TakeRows), rows of 300 floats from a 60 MB table, 2-core AVX-512 Xeon (2 MB of L2 a core), streamed against
// plain stores, interleaved builds: 38 MB 0.54-0.60 of the time, and 0.80 with a sum of the rows read after it;
// 7.7 MB 0.71 (0.91); 1.9 MB 0.86 but 1.18 with the sum; 0.5 MB 1.27 (1.60).
inline bool streams_output(int64_t bytes) { return bytes > l2_bytes() * thread_budget(); }

// dst[0, count) = src[0, count), bit for bit: the whole 64-byte lines of dst written with non-temporal stores where
// the build has AVX or AVX-512 (the line is not read first, and does not stay in cache); with memcpy the partial
// lines at either end, and every line where the build has neither.  A thread calls stream_fence() after its last
// copy, before the loop's output is read.
inline void copy_streaming(float* dst, const float* src, int64_t count) {
#if defined(__AVX512F__) || defined(__AVX__)
  const auto address = reinterpret_cast<uintptr_t>(dst);  // a float's: a multiple of 4
  const int64_t head = std::min<int64_t>(count, (64 - address % 64) % 64 / sizeof(float));
  std::memcpy(dst, src, sizeof(float) * head);
  int64_t i = head;
  for (; i + 16 <= count; i += 16) {
#if defined(__AVX512F__)
    _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
    _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    _mm256_stream_ps(dst + i + 8, _mm256_loadu_ps(src + i + 8));
#endif
  }
  std::memcpy(dst + i, src + i, sizeof(float) * (count - i));
#else
  std::memcpy(dst, src, sizeof(float) * count);
#endif
}

// Orders a thread's non-temporal stores (copy_streaming) before what it does next, such as telling the loop it is done.
inline void stream_fence() {
#if defined(__AVX512F__) || defined(__AVX__)
  _mm_sfence();
#endif
}

// The outputs (given shapes and dtypes) of one CpuLoop call on row-contiguous copies of its inputs.  Inputs past
// the first `read` are not read by the runner, only kept in the graph for their gradients: they are passed as
// they are (a broadcast stays a view: no copy).
template <class Params>
std::vector<mx::array> make_loop(const char* name, typename CpuLoop<Params>::Runner runner,
                                 std::vector<mx::Shape> shapes, std::vector<mx::Dtype> dtypes,
                                 const std::vector<const mx::array*>& inputs, Params params,
                                 typename CpuLoop<Params>::Vjp vjp = nullptr,
                                 typename CpuLoop<Params>::ShapeRule shape_rule = nullptr, size_t read = SIZE_MAX) {
  auto s = cpu_stream();
  std::vector<mx::array> contiguous;
  for (auto* array : inputs) {  // an evaluated row-contiguous array (a weight, a state) is used as it is
    const bool ready = contiguous.size() >= read || (array->is_available() && array->flags().row_contiguous);
    contiguous.push_back(ready ? *array : mx::contiguous(*array, false, s));
  }
  std::vector<mx::Shape> input_shapes;
  for (auto& array : contiguous) input_shapes.push_back(array.shape());
  auto primitive = std::make_shared<CpuLoop<Params>>(s, name, runner, std::move(params), shapes, dtypes,
                                                     std::move(input_shapes), vjp, shape_rule);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), primitive, contiguous);
}

// A row of a row-major 2-D float32 array.
inline float* row_of(mx::array& array, size_t row) { return array.data<float>() + row * array.shape(1); }
inline const float* row_of(const mx::array& array, size_t row) {
  return array.data<float>() + row * array.shape(1);
}

// Each translation unit adds its operations to the extension module.
void register_recurrent(nanobind::module_& m);
void register_bags(nanobind::module_& m);
void register_checks(nanobind::module_& m);
void register_rows(nanobind::module_& m);
void register_losses(nanobind::module_& m);
void register_optim(nanobind::module_& m);

}  // namespace seqlib_cpu
