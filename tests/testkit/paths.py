"""Where things are, for tests that run the repository's scripts."""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "tests", "scripts")       # torchrun and SGLang processes
