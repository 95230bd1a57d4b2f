"""Worker groups: several rank processes acting as one worker over torch.distributed.

`ExpertShard` names the routed experts a rank holds, `SlotExchange` sums a MoE layer's per-(token, slot) outputs
over the group (so a group equals one process bit for bit), and `RankGroup` starts and closes the process group with
a short timeout on every collective.
"""
