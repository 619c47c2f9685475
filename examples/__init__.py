"""Examples of training with context parallelism, nothing downloaded (not part of the installed library):
``python examples/finetune_hf.py``, ``python examples/finetune_trainer.py``,
``python examples/pretrain_megatron.py``.
"""
