"""`python -m vlrl.tools.gpu_check` (see vlrl.tools.gpu_check.cli)."""

import sys

from vlrl.tools.gpu_check.cli import main

sys.exit(main())
