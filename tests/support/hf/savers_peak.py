"""Peak live bytes of one training step (forward and backward) of a small fp32 Llama on the CPU, with each
memory saver: ``python -m tests.support.hf.savers_peak`` from a checkout (a measurement, not a test).

How: the profiler's CPU memory events (``profile_memory=True``: every allocation and free of torch's CPU
allocator, in time order); their running sum over the step, maximised, is the peak live bytes above what
was alive before the step (the parameters). On a GPU the offloaded layer inputs live in host memory; on
the CPU they would be counted with everything else, so here the stash's host copies are made in memory
torch's allocator does not see (numpy's) and counted apart, and the copy back for the recompute is a new
tensor (as the host->device copy is on a GPU). What is left is what a GPU would hold.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch

from cp_attention.memory import offload

CONFIG = dict(vocab_size=1000, hidden_size=512, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2)
TOKENS = 4096
SAVERS = {"none": None, "checkpoint": dict(checkpoint=True), "offload": dict(checkpoint="offload"),
          "mlp_chunks=4": dict(checkpoint=False, mlp_chunks=4),
          "offload+mlp_chunks=4": dict(checkpoint="offload", mlp_chunks=4)}


class _NumpyStash(offload.HostStash):
    """The CPU stash in numpy memory (invisible to the profiler), its host bytes counted in ``live``/``peak``."""

    live = 0
    peak = 0

    def __init__(self, tensor):
        src = tensor.detach()
        self.device, self.requires_grad, self.event = src.device, tensor.requires_grad, None
        self.host = torch.from_numpy(np.empty(tuple(src.shape), dtype=torch.empty(0, dtype=src.dtype).numpy().dtype))
        self.host.copy_(src)
        _NumpyStash.live += self.host.nbytes
        _NumpyStash.peak = max(_NumpyStash.peak, _NumpyStash.live)

    def __del__(self):
        _NumpyStash.live -= self.host.nbytes

    def restore(self):
        return self.host.clone().requires_grad_(self.requires_grad)  # the device copy a GPU would make


@contextlib.contextmanager
def _numpy_stashes():
    original = offload.HostStash
    offload.HostStash = _NumpyStash
    _NumpyStash.live = _NumpyStash.peak = 0
    try:
        yield
    finally:
        offload.HostStash = original


def peak_of_step(model_ref, savers, ids) -> dict:
    """One step of a CP-patched copy of ``model_ref`` (LoopbackGroup(1)) with ``savers``: the peak live
    bytes above the parameters (``peak``), those alive when the backward starts (``kept``: what the forward
    saved for it, the loss's included), the host bytes the offload held at most (``host``), the loss and
    the gradients."""
    from torch.profiler import ProfilerActivity, profile

    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    group = LoopbackGroup(1)
    model = cphf.apply_context_parallel(copy.deepcopy(model_ref), group=group.rank(0), layout="zigzag")
    if savers is not None:
        cphf.save_memory(model, **savers)
    model.train()

    def step(g):
        local = cphf.shard_batch({"input_ids": ids}, group=g, layout="zigzag")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = model(**cphf.model_inputs(local), use_cache=False)
            loss = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=g)
            del out
            with torch.profiler.record_function("savers_peak.backward"):
                loss.backward()
        return prof, loss.detach()

    with _numpy_stashes():
        prof, loss = group.run(step)[0]
        host = _NumpyStash.peak
    kinds = prof.profiler.kineto_results.events()
    backward = min(e.start_ns() for e in kinds if e.name() == "savers_peak.backward")
    events = sorted((e.start_ns(), e.nbytes()) for e in kinds if e.name() == "[memory]")
    live = peak = kept = 0
    for t, nbytes in events:
        if t < backward:
            kept = live + nbytes  # what the forward leaves for the backward (the loss's too)
        live += nbytes
        peak = max(peak, live)
    return {"peak": peak, "kept": kept, "host": host, "loss": loss.item(),
            "grads": [p.grad.detach().clone() for p in model.parameters()]}


def main() -> None:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).float()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, CONFIG["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(1))
    print(f"fp32 Llama {CONFIG}, {TOKENS} tokens, world 1 (LoopbackGroup(1)); parameters {params / 2**20:.1f} MiB")
    print(f"{'savers':<22}{'peak above params':>20}{'kept for backward':>20}{'offloaded (host)':>18}{'loss':>10}"
          f"{'max |dgrad|':>13}")
    base = None
    for name, savers in SAVERS.items():
        r = peak_of_step(model, savers, ids)
        base = base or r
        dgrad = max((a - b).abs().max().item() for a, b in zip(r["grads"], base["grads"]))
        print(f"{name:<22}{r['peak'] / 2**20:>16.1f} MiB{r['kept'] / 2**20:>16.1f} MiB{r['host'] / 2**20:>14.1f} MiB"
              f"{r['loss']:>10.5f}{dgrad:>13.2e}")


if __name__ == "__main__":
    main()
