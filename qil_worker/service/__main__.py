"""``python -m qil_worker.service serve ...`` (same as ``python -m qil_worker serve``)."""

import sys

from qil_worker.service.cli import main

if __name__ == "__main__":
    sys.exit(main())
