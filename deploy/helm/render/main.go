// helm-render renders a Helm chart the way `helm template` does, for machines where Helm
// itself cannot be installed (the test suite's). It is Helm's engine in miniature: Go's
// text/template with sprig (the function library Helm uses) and Helm's own functions
// (include, tpl, required, toYaml, fromYaml, toJson, fromJson, lookup), over .Values
// (values.yaml deep-merged with -f files and --set), .Release, .Chart, .Capabilities,
// .Files and .Template; `_*` partials define templates and render nothing; NOTES.txt is
// not a manifest; values.schema.json, when present, is checked against the merged
// values. Templates run with missingkey=zero and "<no value>" becomes "", as in Helm.
//
//	helm-render [-f values.yaml]... [--set a.b=c]... [--set-string a.b=c]...
//	            [-n namespace] [--kube-version v1.37.0] [-a group/version]...
//	            RELEASE CHART_DIR
//
// It prints the documents as `helm template` does ("---", "# Source: ..."), ordered by
// Helm's install order of kinds, and exits 1 with "Error: ..." on stderr when a template
// fails (`fail`, `required`, a parse error) or a document is not YAML.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/template"

	sprig "github.com/Masterminds/sprig"
	"github.com/ghodss/yaml"
	"github.com/xeipuuv/gojsonschema"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "Error: %s\n", err)
		os.Exit(1)
	}
}

type options struct {
	release, chartDir, namespace, kubeVersion string
	valueFiles, sets, setStrings, apiVersions []string
}

func parseArgs(args []string) (options, error) {
	o := options{namespace: "default", kubeVersion: "v1.37.0"}
	var positional []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, value, hasValue := strings.Cut(a, "=")
		if !strings.HasPrefix(a, "-") {
			positional = append(positional, a)
			continue
		}
		if !hasValue {
			if i+1 >= len(args) {
				return o, fmt.Errorf("flag %s needs a value", a)
			}
			i++
			value = args[i]
		}
		switch name {
		case "-f", "--values":
			o.valueFiles = append(o.valueFiles, value)
		case "--set":
			o.sets = append(o.sets, value)
		case "--set-string":
			o.setStrings = append(o.setStrings, value)
		case "-n", "--namespace":
			o.namespace = value
		case "--kube-version":
			o.kubeVersion = value
		case "-a", "--api-versions":
			o.apiVersions = append(o.apiVersions, value)
		default:
			return o, fmt.Errorf("unknown flag %s", name)
		}
	}
	if len(positional) != 2 {
		return o, errors.New("usage: helm-render [flags] RELEASE CHART_DIR")
	}
	o.release, o.chartDir = positional[0], positional[1]
	if !strings.HasPrefix(o.kubeVersion, "v") {
		o.kubeVersion = "v" + o.kubeVersion
	}
	return o, nil
}

func run(args []string) error {
	o, err := parseArgs(args)
	if err != nil {
		return err
	}
	chart, err := readChartMeta(filepath.Join(o.chartDir, "Chart.yaml"))
	if err != nil {
		return err
	}
	values, err := mergedValues(o)
	if err != nil {
		return err
	}
	if err := checkSchema(o.chartDir, values); err != nil {
		return err
	}
	files, templates, err := readChart(o.chartDir)
	if err != nil {
		return err
	}
	chartName := chart["Name"].(string)
	top := map[string]interface{}{
		"Values": values,
		"Chart":  chart,
		"Release": map[string]interface{}{
			"Name": o.release, "Namespace": o.namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1,
		},
		"Capabilities": capabilities(o),
		"Files":        files,
	}
	rendered, err := renderAll(chartName, templates, top)
	if err != nil {
		return err
	}
	return printManifests(rendered)
}

// readChartMeta reads Chart.yaml into the field names Helm's chart.Metadata has
// (.Chart.Name, .Chart.AppVersion, ...).
func readChartMeta(file string) (map[string]interface{}, error) {
	raw, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var meta map[string]interface{}
	if err := yaml.Unmarshal(raw, &meta); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	out := map[string]interface{}{}
	for k, v := range meta {
		key := strings.ToUpper(k[:1]) + k[1:]
		if k == "apiVersion" {
			key = "APIVersion"
		}
		out[key] = v
	}
	if _, ok := out["Name"].(string); !ok {
		return nil, fmt.Errorf("%s: no name", file)
	}
	return out, nil
}

func mergedValues(o options) (map[string]interface{}, error) {
	values, err := readValues(filepath.Join(o.chartDir, "values.yaml"))
	if err != nil {
		return nil, err
	}
	for _, f := range o.valueFiles {
		user, err := readValues(f)
		if err != nil {
			return nil, err
		}
		values = coalesce(values, user)
	}
	for _, s := range o.sets {
		if err := setValue(values, s, false); err != nil {
			return nil, err
		}
	}
	for _, s := range o.setStrings {
		if err := setValue(values, s, true); err != nil {
			return nil, err
		}
	}
	return values, nil
}

func readValues(file string) (map[string]interface{}, error) {
	raw, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	values := map[string]interface{}{}
	if err := yaml.Unmarshal(raw, &values); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if values == nil {
		values = map[string]interface{}{}
	}
	return values, nil
}

// coalesce merges user over base as Helm does: maps merge key by key, a null in user
// deletes the key, anything else in user replaces.
func coalesce(base, user map[string]interface{}) map[string]interface{} {
	for k, uv := range user {
		if uv == nil {
			delete(base, k)
			continue
		}
		um, uIsMap := uv.(map[string]interface{})
		bm, bIsMap := base[k].(map[string]interface{})
		if uIsMap && bIsMap {
			base[k] = coalesce(bm, um)
		} else {
			base[k] = uv
		}
	}
	return base
}

// setValue applies one --set a.b.c=v (comma-separated pairs; {x,y} lists; true,
// false, null and integers typed unless asString).
func setValue(values map[string]interface{}, expr string, asString bool) error {
	for _, pair := range splitTopLevel(expr) {
		key, raw, ok := strings.Cut(pair, "=")
		if !ok {
			return fmt.Errorf("--set %q: no '='", pair)
		}
		var value interface{} = typed(raw, asString)
		if strings.HasPrefix(raw, "{") && strings.HasSuffix(raw, "}") {
			items := []interface{}{}
			for _, item := range strings.Split(raw[1:len(raw)-1], ",") {
				if item != "" {
					items = append(items, typed(item, asString))
				}
			}
			value = items
		}
		parts := strings.Split(key, ".")
		node := values
		for _, p := range parts[:len(parts)-1] {
			next, ok := node[p].(map[string]interface{})
			if !ok {
				next = map[string]interface{}{}
				node[p] = next
			}
			node = next
		}
		if value == nil {
			delete(node, parts[len(parts)-1])
		} else {
			node[parts[len(parts)-1]] = value
		}
	}
	return nil
}

func splitTopLevel(expr string) []string {
	var out []string
	depth, start := 0, 0
	for i, c := range expr {
		switch c {
		case '{':
			depth++
		case '}':
			depth--
		case ',':
			if depth == 0 {
				out = append(out, expr[start:i])
				start = i + 1
			}
		}
	}
	return append(out, expr[start:])
}

func typed(raw string, asString bool) interface{} {
	if asString {
		return raw
	}
	switch raw {
	case "true":
		return true
	case "false":
		return false
	case "null":
		return nil
	}
	if n, err := strconv.ParseInt(raw, 10, 64); err == nil && (raw == "0" || raw[0] != '0') {
		return n
	}
	return raw
}

func checkSchema(chartDir string, values map[string]interface{}) error {
	raw, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	doc, err := json.Marshal(values)
	if err != nil {
		return err
	}
	result, err := gojsonschema.Validate(gojsonschema.NewBytesLoader(raw), gojsonschema.NewBytesLoader(doc))
	if err != nil {
		return fmt.Errorf("values.schema.json: %w", err)
	}
	if result.Valid() {
		return nil
	}
	var msg strings.Builder
	msg.WriteString("values don't meet the specifications of the schema(s) in the following chart(s):\n")
	for _, e := range result.Errors() {
		fmt.Fprintf(&msg, "- %s\n", e)
	}
	return errors.New(strings.TrimSuffix(msg.String(), "\n"))
}

// files is .Files: the chart's files outside templates/ (and not Chart.yaml, values.yaml
// or values.schema.json), by path relative to the chart.
type files map[string][]byte

func (f files) Get(name string) string      { return string(f[name]) }
func (f files) GetBytes(name string) []byte { return f[name] }
func (f files) Lines(name string) []string {
	return strings.Split(strings.TrimSuffix(string(f[name]), "\n"), "\n")
}
func (f files) Glob(pattern string) files {
	out := files{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			out[name] = data
		}
	}
	return out
}
func (f files) AsConfig() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = string(data)
	}
	out, _ := yaml.Marshal(m)
	return strings.TrimSuffix(string(out), "\n")
}

func readChart(chartDir string) (files, map[string]string, error) {
	fs := files{}
	templates := map[string]string{}
	skip := map[string]bool{"Chart.yaml": true, "values.yaml": true, "values.schema.json": true}
	err := filepath.Walk(chartDir, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(chartDir, p)
		rel = filepath.ToSlash(rel)
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if strings.HasPrefix(rel, "templates/") {
			templates[rel] = string(data)
		} else if !skip[rel] {
			fs[rel] = data
		}
		return nil
	})
	return fs, templates, err
}

type kubeVersion struct{ Version, Major, Minor, GitVersion string }

type apiVersions []string

// Has is .Capabilities.APIVersions.Has: "group/version" or "group/version/Kind".
func (a apiVersions) Has(v string) bool {
	for _, x := range a {
		if x == v || strings.HasPrefix(v, x+"/") {
			return true
		}
	}
	return false
}

func capabilities(o options) map[string]interface{} {
	parts := strings.SplitN(strings.TrimPrefix(o.kubeVersion, "v"), ".", 3)
	minor := ""
	if len(parts) > 1 {
		minor = parts[1]
	}
	builtIn := apiVersions{
		"v1", "apps/v1", "batch/v1", "autoscaling/v1", "autoscaling/v2", "policy/v1",
		"networking.k8s.io/v1", "rbac.authorization.k8s.io/v1", "coordination.k8s.io/v1",
		"storage.k8s.io/v1", "apiextensions.k8s.io/v1", "admissionregistration.k8s.io/v1",
	}
	return map[string]interface{}{
		"KubeVersion": kubeVersion{o.kubeVersion, parts[0], minor, o.kubeVersion},
		"APIVersions": append(builtIn, o.apiVersions...),
		"HelmVersion": map[string]interface{}{"Version": "v3-helm-render"},
	}
}

const recursionMaxNums = 1000

// renderAll parses every template into one set (so partials are shared) and executes
// each file whose name does not start with "_", NOTES.txt excepted.
func renderAll(chartName string, templates map[string]string, top map[string]interface{}) (map[string]string, error) {
	root := template.New("gotpl").Option("missingkey=zero")
	includedNames := map[string]int{}
	funcs := funcMap(root, includedNames)
	root.Funcs(funcs)
	names := make([]string, 0, len(templates))
	for name := range templates {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		full := chartName + "/" + name
		if _, err := root.New(full).Parse(templates[name]); err != nil {
			return nil, fmt.Errorf("parse error in %q: %w", full, err)
		}
	}
	out := map[string]string{}
	for _, name := range names {
		base := path.Base(name)
		if strings.HasPrefix(base, "_") || base == "NOTES.txt" {
			continue
		}
		full := chartName + "/" + name
		data := copyTop(top)
		data["Template"] = map[string]interface{}{"Name": full, "BasePath": chartName + "/templates"}
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, full, data); err != nil {
			return nil, cleanupExecError(full, err)
		}
		out[full] = strings.ReplaceAll(buf.String(), "<no value>", "")
	}
	return out, nil
}

func copyTop(top map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(top)+1)
	for k, v := range top {
		out[k] = v
	}
	return out
}

var failRe = regexp.MustCompile(`error calling (?:fail|required): `)

// cleanupExecError words a failed render as Helm does: "execution error at
// (template:line:col): message", the message being what `fail` or `required` said
// (the innermost, when an include's template failed).
func cleanupExecError(name string, err error) error {
	var execErr template.ExecError
	if !errors.As(err, &execErr) {
		return fmt.Errorf("render error in %q: %w", name, err)
	}
	tokens := strings.SplitN(err.Error(), ": ", 3)
	if len(tokens) != 3 {
		return fmt.Errorf("execution error at (%s): %w", name, err)
	}
	msg := tokens[2]
	if locs := failRe.FindAllStringIndex(msg, -1); locs != nil {
		msg = msg[locs[len(locs)-1][1]:]
	}
	return fmt.Errorf("execution error at (%s): %s", tokens[1], msg)
}

func funcMap(root *template.Template, includedNames map[string]int) template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	f["toYaml"] = toYaml
	f["mustToYaml"] = func(v interface{}) (string, error) {
		out, err := yaml.Marshal(v)
		return strings.TrimSuffix(string(out), "\n"), err
	}
	f["fromYaml"] = fromYaml
	f["fromYamlArray"] = fromYamlArray
	f["toJson"] = toJson
	f["fromJson"] = fromJson
	f["fromJsonArray"] = fromJsonArray
	f["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return v, errors.New(msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return v, errors.New(msg)
		}
		return v, nil
	}
	// Offline, like `helm template`: lookup finds nothing.
	f["lookup"] = func(string, string, string, string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	f["include"] = func(name string, data interface{}) (string, error) {
		if includedNames[name] > recursionMaxNums {
			return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
		}
		includedNames[name]++
		defer func() { includedNames[name]-- }()
		var buf bytes.Buffer
		err := root.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	f["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", fmt.Errorf("cannot parse template %q: %w", text, err)
		}
		var buf bytes.Buffer
		if err := t.Execute(&buf, data); err != nil {
			return "", err
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
	return f
}

func toYaml(v interface{}) string {
	out, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(out), "\n")
}

func fromYaml(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromYamlArray(s string) []interface{} {
	a := []interface{}{}
	if err := yaml.Unmarshal([]byte(s), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

func toJson(v interface{}) string {
	out, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(out)
}

func fromJson(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromJsonArray(s string) []interface{} {
	a := []interface{}{}
	if err := json.Unmarshal([]byte(s), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

// Helm's install order (pkg/releaseutil/kind_sorter.go), which `helm template` prints in.
var installOrder = []string{
	"PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange",
	"PodSecurityPolicy", "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList",
	"ConfigMap", "StorageClass", "PersistentVolume", "PersistentVolumeClaim",
	"CustomResourceDefinition", "ClusterRole", "ClusterRoleList", "ClusterRoleBinding",
	"ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList",
	"Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
	"HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress",
	"APIService",
}

var docSplit = regexp.MustCompile(`(?:^|\s*\n)---\s*`)

type manifest struct {
	source, kind, name, body string
}

func printManifests(rendered map[string]string) error {
	var all []manifest
	names := make([]string, 0, len(rendered))
	for name := range rendered {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		for _, doc := range docSplit.Split(rendered[name], -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var head struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				return fmt.Errorf("YAML parse error on %s: %w", name, err)
			}
			all = append(all, manifest{name, head.Kind, head.Metadata.Name, strings.TrimSpace(doc)})
		}
	}
	rank := func(kind string) int {
		for i, k := range installOrder {
			if k == kind {
				return i
			}
		}
		return len(installOrder)
	}
	sort.SliceStable(all, func(i, j int) bool {
		ri, rj := rank(all[i].kind), rank(all[j].kind)
		if ri != rj {
			return ri < rj
		}
		if all[i].kind != all[j].kind {
			return all[i].kind < all[j].kind
		}
		return all[i].name < all[j].name
	})
	for _, m := range all {
		fmt.Printf("---\n# Source: %s\n%s\n", m.source, m.body)
	}
	return nil
}
