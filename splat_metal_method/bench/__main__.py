"""python -m splat_metal_method.bench: the splat-metal-bench command."""

import sys

from .cli import main

sys.exit(main())
