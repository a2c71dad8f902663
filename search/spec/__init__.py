"""The study file: its schema and validation, its errors, and the masking of the passwords it may hold (bottom layer: imports no other layer)."""
