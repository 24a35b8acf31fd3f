"""Integrations with other libraries; each is imported explicitly and needs its library."""
