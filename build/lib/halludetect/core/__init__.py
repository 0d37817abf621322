"""Infrastructure every phase shares: errors, atomic writes, artifact readers, name lookups, pinned
numerics, devices, resumable unit stores, and the params base class. Imports nothing else of
halludetect.
"""
