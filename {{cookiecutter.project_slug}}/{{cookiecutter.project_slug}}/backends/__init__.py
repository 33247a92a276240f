"""Each backend's forms of the same train step, a module a backend (training/dispatch.py chooses
one: `backend_forms`); a backend without a module runs the stock step."""
