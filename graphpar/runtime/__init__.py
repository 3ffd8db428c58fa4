"""The runtime: workspaces that compile nets into plans and run them (`workspace`), checkpoint files
of their blobs (`checkpoint`) and the load-order checks of a resume (`resume`), and introspection
(`profiler`, `visualize`)."""
