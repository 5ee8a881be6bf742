"""Moving one request's KV between nodes (S2-S7): control messages and channels, the transfer
plan, the context slot, the two messengers, the quarantine, the draft-KV plug-in.
"""
