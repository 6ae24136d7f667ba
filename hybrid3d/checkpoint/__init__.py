"""Checkpoints: their files (files.py), resume plans (resume.py), universal-checkpoint patterns and
resharding (universal.py), the crash-safe commit (commit.py) and the saver the step loop calls (saver.py)."""
