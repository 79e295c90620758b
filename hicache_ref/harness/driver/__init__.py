"""The tree side of the protocol: the state the rules' verbs act on, and what it checks as it goes.

In the order data flows (the verbs themselves are the rule families', ``harness/rules/``):

- ``tree.TreeDriver``: the radix cache's nodes, the writes and loads in flight, the forward
  batch, and the ack drains (a FIFO prefix of completed acks, MIN over CP ranks), over its
  ``node_model`` (one ``Node`` per handle, the pages each holds) and ``rank_geometry`` (where a
  node's bytes live on each rank, from the harness's own CP layout);
- ``uploads``: harness tensors onto a GPU on a side stream, never draining the forward stream;
- ``byte_checks``: every comparison of bytes read back with the content oracle's, the
  free-slot poison watch and forward reads compared once they ran on a GPU;
  ``store_watch``: on the simulator, whether a backup read rows no store wrote;
- ``storage_driver.StorageDriver``: the L3 side (prefetch, storage steps, backups, faults,
  attach/detach), which reads and extends the tree (never the other way round), over
  ``storage_tree`` (upstream's radix-cache side: ongoing prefetches, host locks, policies;
  ``storage_tree_0510`` for 0.5.10's polling protocol), ``storage_chains`` (the harness's own
  pages of each token chain), ``storage_log`` and ``storage_events`` (what the harness recorded
  of every storage op; it reads the driver through a Protocol), ``storage_points`` (a step
  under schedule points: one thread kind to its next point, a body's calls gathered until it
  ends), ``storage_windows`` (what the window checks INV-32 .. INV-35 read) and, in a world
  with an SWA side pool in L3, ``storage_side`` (the tree's window: staged at the hit, judged
  whole), ``storage_side_book`` (the side slots and other requests' host pages the driver
  holds) and ``storage_side_events`` (what the harness records of each window: INV-39), and
  in a ``buffer_only`` world ``storage_buffer`` (the buffer pipeline's tree half: write
  staging freed at the storage ack, each rank's storage existence beliefs beside the harness's
  record of them: INV-41);
- ``pp_world``: a PP world's config and build (``pp_config``, ``build_pp_world``); ``pp_tree.PpTree``: the radix cache's PP half of 0.5.23's prefetch tickets over a world of 2
  PP storage ranks (PP rank 0 submits, the others follow the broadcast tickets; INV-38), over
  ``pp_commands`` (every rank's PP command thread, stepped by whole bodies or by points) and
  ``pp_storage_threads`` (every rank's IO, sync and backup threads, by bodies or by points)
  and ``pp_books`` (what the harness saw of each rank's tickets and host slots), and in a
  world with an SWA side pool ``pp_side`` (the harness's byte model of each ticket's window:
  INV-39); beside the tickets, ``pp_verdict`` (a cache-mode prefetch whose timeout verdict every
  rank polls: PP rank 0's, handed along PP, INV-38).
"""
