"""Circuits: the residual graph's edges, scored (EAP, EAP-IG) and rewired (circuits)."""
