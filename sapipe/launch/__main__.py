"""``python -m sapipe.launch`` is ``sapipe-launch``."""
import sys

from .main import main

sys.exit(main())
