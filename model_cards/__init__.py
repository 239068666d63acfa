"""Model-card templates, rendered by the converters (installed as hybrid_linear_models.model_cards)."""
