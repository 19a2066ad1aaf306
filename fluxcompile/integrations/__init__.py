"""Integrations of fluxcompile's rewrite pass into frameworks that drive Inductor themselves."""
