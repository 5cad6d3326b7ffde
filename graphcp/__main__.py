import sys

from graphcp.tools.cli import main

sys.exit(main())
