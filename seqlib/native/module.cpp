// module.cpp: the Python module of seqlib's CPU primitives, _seqlib_cpu, built by seqlib.native.
//
// recurrent_cpu.cpp (recurrent layers), bags_cpu.cpp (embedding bags), checks_cpu.cpp (value checks),
// rows_cpu.cpp (seqlib.sparse's row sets), losses_cpu.cpp (softmax cross-entropy) and optim_cpu.cpp (the Adam
// update) each register their operations here; cpu_loop.h holds the one primitive class they share.

#include <nanobind/nanobind.h>

#include "cpu_loop.h"

NB_MODULE(_seqlib_cpu, m) {
  m.doc() = "seqlib's CPU primitives for recurrent layers, embedding bags, losses and Adam (built by seqlib.native)";
  seqlib_cpu::register_recurrent(m);
  seqlib_cpu::register_bags(m);
  seqlib_cpu::register_checks(m);
  seqlib_cpu::register_rows(m);
  seqlib_cpu::register_losses(m);
  seqlib_cpu::register_optim(m);
}
