"""``torch.compile``: a patched HF model (and, on gloo ranks, the ring) compile, and compiled equals eager.

Every context-parallel entry point (``ring_attention``, ``plan``, the transports' collectives, the HF
attention and mask functions and the model's forward checks) runs eagerly under ``torch.compile``: a
named graph break (``cp_attention.transport.eager``). These tests pin what that buys:

- the ring compiled at world size 1, on loopback threads and on real gloo ranks (no plan, a plan
  passed in, a plan built inside the compiled function) equals eager, forward and backward;
- a patched tiny Llama compiled (``aot_eager``; ``inductor`` where a C++ compiler is on PATH) gives
  eager's loss and gradients at world size 1 and 2 (threads and processes), packed batches too, and
  still refuses bad input with the eager error (the checks are not compiled away);
- ``fullgraph=True`` fails with a message naming the entry point and why it is a graph break.

Before the fix a process group reached Dynamo, which failed internally ("Member 'exchange' is not
registered"). Tiny shapes: compile time on a small machine is the cost here.
"""

from __future__ import annotations

import pytest
import torch

from cp_attention.transport.loopback import LoopbackGroup
from cp_attention.versions import parse_version
from tests.support.core import compile_cases as cases
from tests.support.core.compile_cases import WHY

_fresh_dynamo = pytest.fixture(autouse=True)(cases.fresh_dynamo)


def test_patched_llama_compiled_at_world_size_1():
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    cases.hf_compiled_vs_eager(None, cases.llama(), cases.batches()[:1], "aot_eager")  # untouched at world size 1


@pytest.mark.skipif(parse_version(torch.__version__) < (2, 13), reason=(
    "Dynamo compiling in two threads at once (the loopback ring's ranks) fails in torch's own metrics context "
    "('Metric(s) ... have already been set in the current context') on torch 2.9.1; 2.13 is the first release "
    "the suite ran it on. Ranks in processes compile on every supported torch (test_compiled_on_gloo_ranks)"))
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not cases.has_cxx(), reason="inductor on CPU needs a C++ compiler (g++, c++ or clang++; $CXX names another)"))])
def test_patched_llama_compiled_on_loopback(backend):
    """Two ranks as threads of this process: Dynamo compiles each rank's model (one cache entry each)."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    base, batches = cases.llama(), cases.batches()
    LoopbackGroup(2).run(lambda h: cases.hf_compiled_vs_eager(h, base, batches, backend))
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert any(WHY in reason for reason in breaks), f"CP ran traced, not as graph breaks: {list(breaks)}"
    if backend == "aot_eager":  # the forward checks still run, and refuse as in eager
        eager, compiled = LoopbackGroup(2).run(lambda h: (cases.bad_positions_error(h, base, None),
                                                         cases.bad_positions_error(h, base, backend)))[0]
        assert compiled == eager


@pytest.mark.slow
def test_compiled_on_gloo_ranks(pools):
    """Real processes: a process group is what Dynamo failed on before."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    for rank, diffs in enumerate(pools(2).run(cases.gloo_case, timeout=240)):
        fullgraph = diffs.pop("fullgraph")
        for name, diff in diffs.items():
            assert diff <= 1e-5, f"rank {rank}, {name}: compiled differs from eager by {diff}"
        assert WHY in fullgraph, fullgraph  # at the first CP entry point it meets (the mask function)
