"""Compiled programs the planner plans for: the cache of issued programs (`cache.ProgramCache`) and
the fitted menu of buckets (`menu.BucketMenu`)."""
