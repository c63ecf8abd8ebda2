"""What claims are measured against: the unaligned `baseline`, the consistent-but-straightforward
`naive`, third-party stacks, and published peer figures."""
