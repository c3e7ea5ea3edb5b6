"""The check's inputs: the checkpoint (given, published and seeded, or tiny; validated once, its identity),
shipped and quantized directories, a given program, the prompt tokens, and what is refused before any
work. Reads models/; never calls back up."""
