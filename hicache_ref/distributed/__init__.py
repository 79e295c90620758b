"""Context parallel across processes: one OS process per CP rank, agreeing through
``torch.distributed`` (gloo on CPU; NCCL with one GPU per rank).

The lockstep harness drives every CP rank in one process; here each rank is its own process
with its own controller, pools and device, and the ranks agree on everything the lockstep
tree decided over all of them at once. Primitives, in the order a case flows through them:

- ``launcher.spawn_world``: spawn one process per rank, kill any left at the deadline, collect
  each rank's ``RankReport`` (``reports``: the ``WorldSpec`` every rank is told, and what it
  reports);
- ``group.open_group``: join the process group (file store, a timeout on every collective,
  NVLink multicast off in every process);
- ``rank_campaign.run_rank``: rank 0 picks each case (a seeded CP config, or the trace to
  replay) and broadcasts it;
- ``rank_session.open_rank_session``: that rank's ``Session`` over a world of itself alone (on
  NCCL its device is ``cuda_device.CudaRankDevice``, one GPU per rank);
- ``driver.drive_case``: the case's loop, three collectives per step, through the four below;
- ``schedule.StepProgram``: rank 0 draws each step from its session (seeded), then broadcasts;
- ``agreement.plan_step`` -> ``agreement.agree``: before the step, every rank's view (enabled
  here? acks ready? does a reservation fit here?) gathered into one decision;
- ``compare.digest_rank`` -> ``compare.find_divergence``: after the step, every rank's ack rows,
  pages, producer slot and tree gathered and compared (INV-14; host slots add up, INV-05);
- ``verdict.decide``: a rank's exception or a divergence becomes one verdict, the same one-line
  message and replay line on every rank; rank 0 writes the trace (``cp_processes`` in its header);
- ``campaign.run_cp_campaign`` / ``campaign.replay_cp_trace``: the parent's report;
  ``commands``: the ``hicache-fuzz run --cp-processes N`` and ``replay`` entry points.
"""
