"""``python -m sapipe.launch`` is ``sapipe-launch``."""

import sys

from sapipe.launch.main import main

sys.exit(main())
