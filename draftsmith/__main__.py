"""`python -m draftsmith STAGE CONFIG` (and `accelerate launch -m draftsmith ...`, `torchrun -m draftsmith ...`)."""

import sys

from draftsmith.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
