"""Microscaling (MX) number formats: MXFP4 weights and MXFP8 activations."""
