"""Fine-tune a tiny Llama with transformers' ``Trainer`` (or TRL's ``SFTTrainer``) and context
parallelism, nothing downloaded.

The one change to a Trainer script is the class: ``cphf.context_parallel_trainer(Trainer)`` and
``cp_size``/``cp_layout`` (and ``cp_comm_type``) in its constructor. The CP Trainer's loss runs the LM head
and cross-entropy over chunks of tokens by default (``--loss-chunk-tokens``, the constructor's
``cp_loss_chunk_tokens``); ``--activation-checkpointing`` and ``--mlp-chunks`` are its
``cp_activation_checkpointing`` and ``cp_mlp_chunks``. The data are Python's bundled help topics as bytes (one
example per topic, cut to ``--seq-len``); ``--packing`` flattens each batch's examples into one row of
documents (``DataCollatorWithFlattening``), and ``--sft`` trains with TRL's ``SFTTrainer`` and its
packing instead.

Run without torchrun, it starts itself under torchrun with --nproc ranks (gloo on CPU).

    python examples/finetune_trainer.py                         # 2 ranks: dp=1 x cp=2
    python examples/finetune_trainer.py --nproc 4 --cp-size 2   # dp=2 x cp=2
    python examples/finetune_trainer.py --packing               # DataCollatorWithFlattening
    python examples/finetune_trainer.py --packing --layout balanced   # documents placed per batch
    python examples/finetune_trainer.py --sft                   # TRL's SFTTrainer with packing
    python examples/finetune_trainer.py --activation-checkpointing offload --mlp-chunks 4
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `examples` imports from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import tempfile

import torch

from cp_attention.strategies import CP_COMM_TYPES
from cp_attention.training.cli import memory_options, memory_savers
from cp_attention.training.data import load_documents
from cp_attention.training.summary import example_summary, shown
from examples.finetune_hf import build_model

__all__ = ["parser", "train", "id_tokenizer", "torchrun_command"]


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks torchrun starts (when not under torchrun already)")
    p.add_argument("--cp-size", type=int, default=None,
                   help="context-parallel group size (default: every rank); dp = ranks / cp-size")
    p.add_argument("--layout", default="zigzag",
                   help="contiguous, zigzag, interleaved or balanced (with --packing or --sft: placed per batch from "
                        "its documents)")
    p.add_argument("--cp-comm-type", default="p2p", choices=[n for n in CP_COMM_TYPES if n != "a2a+p2p"],
                   help="how K/V travel (the Trainer's CP group is one level: no a2a+p2p)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="examples per dp rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--packing", action="store_true", help="DataCollatorWithFlattening: one row of documents")
    p.add_argument("--sft", action="store_true", help="TRL's SFTTrainer with its packing")
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary one)")
    return memory_options(p)


def torchrun_command(argv: list[str], nproc: int) -> list[str]:
    """The command that starts this script under torchrun with ``nproc`` ranks and this script's options
    ``argv`` but ``--nproc``: the ranks do not read it, and torchrun's own parser refuses it as an
    ambiguous abbreviation of its --nproc-per-node / --nproc_per_node, even after the script's name."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True  # and its value
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(Path(__file__).resolve()), *kept]


def id_tokenizer(vocab_size: int, pad_id: int, eos_id: int):
    """A tokenizer whose token ``i`` is the word ``<i>``, built in memory (SFTTrainer wants one; the
    examples' data are token ids already): ``vocab_size`` tokens, ``pad_id`` and ``eos_id`` among them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=f"<{pad_id}>")),
                                   pad_token=f"<{pad_id}>", eos_token=f"<{eos_id}>")


def train(args: argparse.Namespace) -> dict:
    """Train on this rank (under torchrun); returns the Trainer's last logged metrics."""
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf

    docs = [d[: args.seq_len].tolist() for d in load_documents("builtin") if d.numel() > 16]
    if not (args.packing or args.sft):  # fixed-length rows for the default collator
        docs = [d for d in docs if len(d) == args.seq_len]
    rows = [{"input_ids": d, "labels": d} for d in docs]
    common = dict(output_dir=args.output_dir or tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
                  max_steps=args.steps, learning_rate=args.lr, logging_steps=5, report_to=[], save_strategy="no",
                  disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                  ddp_find_unused_parameters=False)  # every parameter is used: spare DDP's search (and its warning)
    model = build_model(seed=0)
    if args.sft:
        import datasets
        import trl

        base, extra = trl.SFTTrainer, dict(
            args=trl.SFTConfig(**common, bf16=False, packing=True, max_length=args.seq_len),
            train_dataset=datasets.Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows]),
            processing_class=id_tokenizer(256, pad_id=0, eos_id=10))  # bytes: newline ends
    else:
        collator = tf.DataCollatorWithFlattening() if args.packing else tf.default_data_collator
        base, extra = tf.Trainer, dict(args=tf.TrainingArguments(**common, remove_unused_columns=False),
                                       train_dataset=rows, data_collator=collator)
    CPTrainer = cphf.context_parallel_trainer(base)  # the one change
    chunk_tokens, checkpoint, mlp_chunks = memory_savers(args)
    cp_size = args.cp_size or int(os.environ.get("WORLD_SIZE", 1))
    trainer = CPTrainer(model=model, cp_size=cp_size, cp_layout=args.layout,
                        cp_comm_type=getattr(args, "cp_comm_type", "p2p"), cp_loss_chunk_tokens=chunk_tokens,
                        cp_activation_checkpointing=checkpoint, cp_mlp_chunks=mlp_chunks, **extra)
    trainer.train()
    if not args.output_dir and not os.listdir(common["output_dir"]):
        os.rmdir(common["output_dir"])  # our temporary default, left empty (save_strategy="no")
    if trainer.is_world_process_zero():
        print(_summary(args, common["output_dir"], trainer.state.log_history), flush=True)
    return trainer.state.log_history[-1]


def _summary(args: argparse.Namespace, output_dir: str, history: list[dict]):
    """The example's summary from the Trainer's log: its loss records, its speed (samples/s x
    ``--seq-len``: rows of at most that many tokens, so an upper bound with ``--packing``), what the
    output directory holds."""
    last = history[-1] if history else {}
    samples_s = last.get("train_samples_per_second")
    kept = sorted(p.name for p in Path(output_dir).iterdir()) if Path(output_dir).is_dir() else []
    written = (f"{shown(output_dir)}{os.sep} ({', '.join(kept)})" if kept else
               "printed above (stdout) only: nothing saved (save_strategy='no')")
    logged = [r for r in history if "loss" in r]
    return example_summary("finetune_trainer.py", [r["loss"] for r in logged],
                           samples_s * args.seq_len if samples_s else None, written, [r["step"] for r in logged])


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    if "RANK" not in os.environ:  # start the ranks under torchrun, as a user would
        command = torchrun_command(sys.argv[1:], args.nproc)
        os.execv(command[0], command)
    last = train(args)
    if int(os.environ["RANK"]) == 0:
        print(f"done: {last}")
