"""MetaWorld: 50 Sawyer tabletop tasks (MT1, MT10, MT50), one subprocess per env."""
