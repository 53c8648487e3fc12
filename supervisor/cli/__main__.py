"""``python -m supervisor.cli``."""

from __future__ import annotations

import sys

from supervisor.cli.app import main

sys.exit(main())
