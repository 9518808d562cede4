import os

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run through Triton's interpreter on CPU; triton.jit reads this when the kernels (and
    # triton.language itself) are first imported, so it is set before any test module can import them.
    os.environ.setdefault("TRITON_INTERPRET", "1")
