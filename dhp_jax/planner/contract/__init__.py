"""The plan contract: `Plan` and its groups (plan.py), plan files (planfile.py), attention kinds (kinds.py)."""
