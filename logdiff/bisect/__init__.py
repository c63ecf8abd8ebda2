"""Where a stack's two paths first differ: capture points of a forward (`capture`), the search for the
first differing op and its class, kernel path or upstream (`locate`), and the pictures (`plots`)."""
