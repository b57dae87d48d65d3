"""Ground floor: tensor-tree helpers and error types that every layer may import; imports nothing of kiln."""
