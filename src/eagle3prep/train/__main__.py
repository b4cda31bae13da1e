"""`python -m eagle3prep.train -- <speculators train args>`; for several GPUs:
`torchrun --nproc_per_node=8 -m eagle3prep.train -- <the same args>`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
