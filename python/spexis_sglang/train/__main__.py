"""``python -m spexis_sglang.train``: see :mod:`spexis_sglang.train.cli`."""

import sys

if __name__ == "__main__":
    from spexis_sglang.cpu_support import activate

    activate()
    from spexis_sglang.train.cli import main

    sys.exit(main())
