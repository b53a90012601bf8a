"""rlstream: asynchronous RL post-training for LLMs on Redis streams."""

__version__ = "0.1.0"

import logging as _logging

# torchao (actor.fp8), which transformers imports whenever it is installed, warns at import about each CUDA kernel
# library it cannot load and torch's pytree about each enum it registers: noise on every CPU process.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
