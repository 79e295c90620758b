"""The world of one case, as the harness builds it: what is simulated, and what it holds.

In the order a case is set up:

- ``config.HarnessConfig``: the geometry, layouts, io backend, CP ranks, draft, pool kind,
  copy path, storage and seed of one case (a trace header carries it);
- ``world.build_world``: the device (``SimDevice``, or the GPU's), every rank's pools,
  allocator and controller built by the implementation, the copy launchers that tag each copy
  with its rank and pool; ``storage_world``: the L3 side of a storage case (every rank's tier,
  the rank group); ``storage_config``: the storage fields a case draws;
  ``recording_storage``: the backend wrapper whose record the harness reads; ``side_pools``:
  an independent side pool (the SWA entry of a ``HostPoolGroup``, rows and slots of its own);
- ``content``: the bytes the content oracle predicts for every node, layer and row.
"""
