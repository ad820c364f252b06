"""``python -m llmgpu``: the same as the ``llmgpu`` command."""

import sys

from .cli import main

sys.exit(main())
