"""mpzero: Megatron-style tensor parallelism and ZeRO data parallelism for GPT pretraining.

Importing the package has no side effects: no process groups, no threads, no seeding.
"""

__version__ = "0.1.0"
