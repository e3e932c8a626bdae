"""The cost model: coefficients (`model.CostModel`, derived from `presets`), pricing (`pricing`), the
executor's stream geometry (`geometry`), the engine's bytes (`memory`), and fitting coefficients to
measured steps (`fit`)."""
