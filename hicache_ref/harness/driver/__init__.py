"""The tree side of the protocol, as verbs the rules call, and what it checks as it goes.

In the order data flows:

- ``tree.TreeDriver``: prefill -> forward layers -> write / reserve / submit -> drains ->
  evict_device / drop -> load -> start_loading -> forward reads -> evict_host -> cancel ->
  reset, on every rank in lockstep, over its ``node_model`` (one ``Node`` per handle, the
  pages each holds) and ``rank_geometry`` (where a node's bytes live on each rank, from the
  harness's own CP layout);
- ``uploads``: harness tensors onto a GPU on a side stream, never draining the forward stream;
- ``byte_checks``: every comparison of bytes read back with the content oracle's, the
  free-slot poison watch and forward reads compared once they ran on a GPU;
  ``store_watch``: on the simulator, whether a backup read rows no store wrote;
  ``probes``: misuse the controller must refuse;
- ``storage_driver.StorageDriver``: the L3 side (prefetch, storage steps, backups, faults,
  attach/detach) over ``storage_tree`` (upstream's radix-cache side: ongoing prefetches, host
  locks, policies; ``storage_tree_0510`` for 0.5.10's polling protocol), ``storage_chains``
  (the harness's own pages of each token chain), ``storage_log`` and ``storage_events`` (what
  the harness recorded of every storage op), ``storage_points`` (a step under schedule points:
  one thread kind to its next point, a body's calls gathered until it ends) and
  ``storage_windows`` (what the window checks INV-32 .. INV-35 read).
"""
