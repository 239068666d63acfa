"""Model-card templates, rendered by the converters (package data of hybrid_linear_models)."""
