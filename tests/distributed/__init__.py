"""Tests over spawned gloo worlds: worlds.py (the pooled worlds), reports.py (putting the ranks' reports together)."""
