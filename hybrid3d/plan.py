"""`python -m hybrid3d.plan`: the layout planner's command line (hybrid3d/planning/planner.py)."""

import sys

from hybrid3d.planning.planner import main

if __name__ == "__main__":
    sys.exit(main())
