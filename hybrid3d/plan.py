"""`python -m hybrid3d.plan`: the layout planner's command line (hybrid3d/planning/plan_cli.py).

The planner's modules import DeepSpeed (its partition solver, schedules and topology), whose import logs its
accelerator detection; a plan needs no accelerator, and like every command of the package this one starts quiet
(hybrid3d/__init__.py), so its answer comes first and alone."""

import sys

from hybrid3d.planning.plan_cli import main

if __name__ == "__main__":
    sys.exit(main())
