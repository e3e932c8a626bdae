"""The solvers behind `plan_batch`: the strategy registry (`strategies`), the problem they share
(`problem`), DHP's search (`dhp`, `allocate`, `packing`, `microbatch`, `refine`, `placement`), the
baselines (`baselines`, `flexsp`, `milp`), and `build`, which turns a solver's groups into a priced plan."""
