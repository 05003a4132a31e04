"""Development harnesses, shipped in the distribution but never imported by the operator or the agent.

``reference_engine`` (a small real TP transformer behind SGLang-shaped routes), ``loopback_group`` (a
whole group as local processes), the stock engines' servers and virtualenvs. The emulated testbed, which measures
rather than tests, is a tool (``weightsync_tools.testbed``).
"""
