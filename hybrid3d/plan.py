"""`python -m hybrid3d.plan`: the layout planner's command line (hybrid3d/planning/plan_cli.py)."""

import sys

from hybrid3d.training.quiet_start import hold_back_deepspeed_log

# The planner's modules import DeepSpeed (its partition solver, schedules and topology), whose import logs its
# accelerator detection; a plan needs no accelerator, so its answer comes first and alone.
hold_back_deepspeed_log()

from hybrid3d.planning.plan_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
