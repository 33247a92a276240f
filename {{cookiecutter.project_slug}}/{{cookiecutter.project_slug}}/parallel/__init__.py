"""Devices and hosts: the mesh and shardings, pmap's replicated state, joining the
cluster, the chips' figures."""
