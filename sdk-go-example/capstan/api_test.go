package capstan_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strings"
	"testing"
)

// TestTheExportedAPIHasNoGeneratedTypes keeps the generated protocol code an implementation
// detail: no exported function, method, type, field, variable or constant mentions it, so a
// change of the generated code never breaks a user.
func TestTheExportedAPIHasNoGeneratedTypes(t *testing.T) {
	fset := token.NewFileSet()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		generated := map[string]bool{}
		for _, imp := range file.Imports {
			if strings.Contains(imp.Path.Value, "/gen/") || strings.Contains(imp.Path.Value, "google.golang.org/") {
				alias := imp.Path.Value[strings.LastIndex(imp.Path.Value, "/")+1 : len(imp.Path.Value)-1]
				if imp.Name != nil {
					alias = imp.Name.Name
				}
				generated[alias] = true
			}
		}
		check := func(what string, node ast.Node) {
			if node == nil {
				return
			}
			ast.Inspect(node, func(n ast.Node) bool {
				if sel, ok := n.(*ast.SelectorExpr); ok {
					if id, ok := sel.X.(*ast.Ident); ok && generated[id.Name] {
						t.Errorf("%s: %s mentions %s.%s", fset.Position(n.Pos()), what, id.Name, sel.Sel.Name)
					}
				}
				return true
			})
		}
		for _, decl := range file.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() || (d.Recv != nil && !exportedReceiver(d.Recv)) {
					continue
				}
				check(d.Name.Name, d.Type)
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					switch s := spec.(type) {
					case *ast.TypeSpec:
						if !s.Name.IsExported() {
							continue
						}
						if st, ok := s.Type.(*ast.StructType); ok {
							for _, f := range st.Fields.List {
								for _, n := range f.Names {
									if n.IsExported() {
										check(s.Name.Name+"."+n.Name, f.Type)
									}
								}
							}
							continue
						}
						check(s.Name.Name, s.Type)
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.IsExported() {
								check(n.Name, s.Type)
								for _, v := range s.Values {
									check(n.Name, v)
								}
							}
						}
					}
				}
			}
		}
	}
}

func exportedReceiver(recv *ast.FieldList) bool {
	if len(recv.List) == 0 {
		return false
	}
	typ := recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	id, ok := typ.(*ast.Ident)
	return ok && id.IsExported()
}
