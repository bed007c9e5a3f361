"""serval inside the libraries MoE models are trained with; each module is optional and imports its library.

    transformers.py   the experts implementation "serval" (`experts_implementation="serval"`), its expert-parallel
                      implementation, and `use_serval(model, config)` for a per-model `serval.Config`
    torchtitan.py     a serval backend for torchtitan's MoE: its routed experts on `serval.moe`, expert
                      parallelism from the EP mesh

Nothing here is imported by `import serval`: `pip install serval` needs neither library
(`pip install 'serval[transformers]'` / `'serval[torchtitan]'` bring them).
"""

# the oldest transformers whose experts and expert-parallel interfaces `transformers.py` registers with (as
# pyproject's extra "transformers" pins it); older ones are refused at import by name
TRANSFORMERS_MIN = "5.23"
