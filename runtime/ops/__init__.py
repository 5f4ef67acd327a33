"""The ``hybrid::`` op vocabulary. Importing this package registers every op with torch.library."""
